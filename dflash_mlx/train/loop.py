"""Stage 3 of a run, the training loop (`train_loop`): steps, held-out τ every --eval-every, checkpoints every
--checkpoint-every, the --max-minutes stop, the progress bar, and at the end the written drafter and the summary
lines. Every rank of a data-parallel group runs it in lockstep; rank 0 alone evaluates, prints and writes."""

from __future__ import annotations

from pathlib import Path

from .export import save_checkpoint, write_drafter


def train_loop(state, log, group) -> Path:
    """The training loop, evaluations, checkpoints and the written drafter (rank 0 of a group writes)."""
    import time

    from tqdm import tqdm

    from .card import projection_text
    from .parallel import DataParallel
    from .trainer import held_out_tau

    args, tokenizer, target, drafter, trainer, cache, extraction = state
    out = Path(args.out)
    if group is not None and group.size() > 1:
        trainer.join(DataParallel(group))
        trainer.device += f" x {group.size()} data-parallel ranks"
    leader = group is None or group.rank() == 0
    ranks = 1 if group is None else group.size()
    stops = list(getattr(tokenizer, "eos_token_ids", None) or [])

    def evaluate():
        if not cache.eval_prompts:
            return None
        r = held_out_tau(target, drafter, cache.eval_prompts, max_tokens=args.eval_tokens, stop_tokens=stops)
        trainer.history.append({"step": trainer.step, "slots": trainer.predicted, "flops": trainer.flops,
                                "tau": round(r["tau"], 4), "passes": r["passes"]})
        return r["tau"]

    tau = trainer.history[-1]["tau"] if trainer.history else None
    if trainer.step == 0 and not trainer.history and leader:
        tau = evaluate()
        log(f"held-out τ before training: {tau}")
    cfg = trainer.config
    shared = f", shared by {ranks} data-parallel ranks" if ranks > 1 else ""
    log(f"training: {cfg.accum} micro-batch(es) of {cfg.rows_per_step} row(s) x {cfg.anchors} anchors = "
        f"{cfg.accum * cfg.micro_blocks} blocks per step{shared}, {trainer.flops_per_micro * cfg.accum / 1e12:.2f} "
        f"TFLOP per step, labels from the {cfg.labels}")
    bar = tqdm(total=args.steps, initial=trainer.step, desc="training", unit="step",
               disable=not (args.progress and leader))
    loss_ema = None
    started, slots0, elapsed0 = time.perf_counter(), trainer.predicted, trainer.elapsed
    step0, after_first = trainer.step, None  # the step time without the first step's compilation
    while trainer.step < args.steps:
        if args.max_minutes is not None:
            stop = time.perf_counter() - started > 60 * args.max_minutes
            if trainer.parallel is not None:
                stop = trainer.parallel.agree(stop)  # rank 0's clock decides for every rank
            if stop:
                log(f"--max-minutes {args.max_minutes} reached at step {trainer.step}; continue with --resume")
                break
        m = trainer.train_step()
        if after_first is None:
            after_first = trainer.elapsed
        loss_ema = m["loss"] if loss_ema is None else 0.95 * loss_ema + 0.05 * m["loss"]
        if not leader:
            continue
        if args.eval_every and trainer.step % args.eval_every == 0:
            tau = evaluate()
        if args.checkpoint_every and trainer.step % args.checkpoint_every == 0:
            save_checkpoint(out, args, trainer)
        held = "-" if tau is None else f"{tau:.2f}"
        rate = (trainer.predicted - slots0) / max(trainer.elapsed - elapsed0, 1e-9)
        bar.set_postfix_str(f"loss {loss_ema:.3f} acc1 {m['acc1']:.2f} train-τ {m['tau']:.2f} held-out τ {held} "
                            f"{rate:.0f} slots/s", refresh=False)
        bar.update(1)
    bar.close()
    if not leader:
        return out
    if trainer.history and trainer.history[-1]["step"] == trainer.step:
        tau = trainer.history[-1]["tau"]
    else:
        tau = evaluate()
    save_checkpoint(out, args, trainer)
    write_drafter(out, args, drafter, trainer, cache, extraction)
    rate = (trainer.predicted - slots0) / max(trainer.elapsed - elapsed0, 1e-9)
    steady = ""
    if after_first is not None and trainer.step - step0 > 1:
        steady = f", {(trainer.elapsed - after_first) / (trainer.step - step0 - 1):.4f} s/step after the first"
    log(f"{trainer.step} steps, {trainer.predicted} slots in {trainer.elapsed:.0f} s ({rate:.0f} slots/s this "
        f"session{f' on {ranks} ranks' if ranks > 1 else ''}{steady}); held-out τ {tau}; wrote {out}")
    log(projection_text(trainer.history))
    return out

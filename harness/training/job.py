"""One run in its run directory: `run(cfg, run_dir) -> Summary` is the testable core of the entry
point. It takes the run lock, agrees with the other ranks where the run starts, opens the tracker,
builds the Trainer, fits, and writes the summary on every way out (atomic, also on failure)."""

from __future__ import annotations

import contextlib
import gc
import logging
import time
import traceback
import warnings
from dataclasses import asdict
from pathlib import Path

import torch
from omegaconf import OmegaConf

from harness import recipes
from harness.backends import determinism
from harness.backends.hardware import device_for
from harness.config.errors import ConfigError, ConfigWarning
from harness.config.schema import TE_EXACT_VERSION, Config
from harness.lifecycle import artifacts as A
from harness.lifecycle import checkpoint as ckpt
from harness.lifecycle import resume as R
from harness.lifecycle import warm_start as W
from harness.lifecycle.artifacts import NullWriter, RunWriter, Summary, provenance
from harness.lifecycle.loggers import NullLogger, open_logger, sweep_group, wandb_config
from harness.lifecycle.runlock import RunDirLocked, RunLock
from harness.lifecycle.signals import StopRequest
from harness.model import schedule
from harness.parallel import agree
from harness.parallel import process as D
from harness.parallel.agree import RankFailed
from harness.training.trainer import Trainer, backend_name, variant
from harness.validation import prepare

log = logging.getLogger("lowp")

USER_ERRORS = (ConfigError, RunDirLocked, ckpt.CheckpointError, OSError)
"""Errors of the user's setup, not of lowp: one line, no traceback, exit code 2 (config) or 1."""


class UserCodeExit(RuntimeError):
    """User code run by the trainer (a quantizer factory) called sys.exit: the run fails, and a
    multirun's next job still starts (a SystemExit would end the whole process)."""


def run(
    cfg: Config, run_dir: Path, stop: StopRequest | None = None, resume_command: str | None = None
) -> Summary:
    """Train (or resume) and write one complete run directory; returns its summary.

    `cfg` comes from `harness.validation.load` (or a composed Config: it is prepared here the same way,
    hardware resolved, stability overrides resolved, validated) before anything is written. One
    process at a time writes a run dir (RunLock); with a checkpoint there and resume=auto|must the run
    continues from it; a failure is recorded in summary.json and error.txt, then re-raised.

    Under torchrun or Slurm tasks every rank calls this: the process group starts here (after
    validation), rank 0's run dir is everyone's, and only rank 0 writes run.json, metrics and W&B."""
    config_warnings: list[str] = []
    cfg = prepare(cfg, warnings_out=config_warnings)
    p = cfg.parallel
    undo = determinism.enable() if cfg.backend.deterministic else None  # before NCCL, cuBLAS and TE read it
    try:
        dist = D.setup(p.strategy, p.backend, p.timeout_s, device_for(cfg.hardware))
    except BaseException:
        if undo:
            undo()
        raise
    try:
        run_dir = agree.shared_run_dir(dist, Path(run_dir))
        if not dist.is_main:
            logging.getLogger("lowp").setLevel(logging.WARNING)  # rank 0 speaks for the job
        return _run(cfg, run_dir, stop, resume_command, config_warnings, dist)
    finally:
        D.teardown(dist)
        release_memory()
        if undo:
            undo()


def release_memory() -> None:
    """Free the finished run's model, optimizer and activations before anything else runs in this
    process (a sweep's next job, a benchmark's next run): its modules sit in reference cycles (hooks,
    probes, TE's modules) that only the cyclic collector frees, and until it runs their device memory
    stays allocated and counts in the next run's peak (measured on the H200: +17.7 GiB per run of the
    2-layer Mixtral-like slice, until a run ran out of memory)."""
    if torch.cuda.is_available():  # on a CPU the collector's own schedule is enough
        gc.collect()
        torch.cuda.empty_cache()


def _run(
    cfg: Config, run_dir: Path, stop, resume_command, config_warnings: list[str], dist: D.Dist
) -> Summary:
    lock = RunLock(run_dir) if dist.is_main else contextlib.nullcontext()
    with agree.agreed(dist, lock, refused=RunDirLocked):
        if dist.is_main:
            ckpt.remove_partial(run_dir)  # a write killed by SIGKILL: its temporary directory
        found = agree.agreed_start(
            dist,
            lambda: R.resume_point(cfg.resume, run_dir, asdict(cfg)),
            lambda path: (path, *ckpt.load_one(path)),
        )
        warm = W.find(cfg.warm_start) if cfg.warm_start and found is None else None
        if warm is not None:
            W.check(warm, asdict(cfg))  # refused before anything is written
        previous = R.previous_run_json(run_dir)  # its attempts go on; its W&B run only with its checkpoint
        resolved = backend_name(cfg)
        summary = Summary(
            recipe=cfg.recipe.name,
            recipe_label=recipes.label(cfg.recipe),
            variant=variant(cfg),
            hardware=cfg.hardware.name,
            model=cfg.model.name,
            data=cfg.data.name,
            seed=cfg.seed,
        )
        config = OmegaConf.to_container(OmegaConf.structured(cfg), resolve=True)
        tracker = (  # opened once the trainer is built: a refused run leaves no W&B run behind
            open_logger(
                cfg.logger,
                run_dir=run_dir,
                name=cfg.name or f"{recipes.label(cfg.recipe)} s{cfg.seed}",
                group=sweep_group(run_dir),
                job_type=cfg.recipe.name,
                tags=[t[:64] for t in (cfg.recipe.name, recipes.label(cfg.recipe), resolved, variant(cfg))],
                config=config,
                run_id=((previous or {}).get("wandb") or {}).get("run_id") if found else None,
            )
            if dist.is_main
            else contextlib.nullcontext(NullLogger())
        )
        job = _Job(cfg, run_dir, summary, config, tracker, stop or StopRequest(), found, previous, dist)
        job.warm = warm
        return job.train(resume_command, config_warnings)


class _Job:
    """One attempt of one run: what `run` opened, handed to the trainer."""

    def __init__(
        self,
        cfg: Config,
        run_dir: Path,
        summary: Summary,
        config: dict,
        tracker,
        stop,
        found,
        previous,
        dist=D.SINGLE,
    ):
        self.cfg, self.run_dir, self.summary, self.config = cfg, run_dir, summary, config
        self.tracker, self.stop, self.found, self.previous, self.dist = tracker, stop, found, previous, dist
        self.started = False  # this attempt has begun writing the run dir (its rows, its run.json)
        self.warm = None  # (path, step, state) of cfg.warm_start's checkpoint on a fresh start

    agreed = False

    def _agree(self, failed: bool) -> None:
        """Every rank's way out, once: a rank that failed outside a collective (an eval, the last
        step's summary) would leave the others reporting success. Failing ranks take part too
        (their peers may be gone already: then there is nothing to agree with)."""
        if not self.dist.active or self.agreed:
            return
        self.agreed = True
        if agree.any_failed(self.dist, failed) and not failed:
            first = A.first_rank_failure(self.run_dir)
            raise RankFailed(f"another rank failed: {first[1] if first else 'see its error.rank*.txt'}")

    def train(self, resume_command: str | None, config_warnings: list[str]) -> Summary:
        """Build the trainer, open the tracker, fit, and write the summary on every way out (atomic,
        also on failure).

        A failure is recorded (summary.json `failed`, error.txt) once this attempt has started
        writing (its rows, its run.json), or when it crashed building a fresh run. Before that, a
        refusal (a ConfigError: bad data, W&B without credentials, a checkpoint of other data)
        writes nothing, and a directory holding an earlier run keeps that run's files as they were."""
        summary, dist = self.summary, self.dist
        writer = RunWriter(self.run_dir, append=self.found is not None) if dist.is_main else NullWriter()
        fresh = self.found is None and self.previous is None
        record = False
        earlier = A.earlier_wall_time(self.run_dir) if self.found else 0.0  # resumed: the attempts before
        t0 = time.perf_counter() - earlier
        try:
            trainer = self._build(writer)
            with self.tracker as logger:
                trainer.logger = logger
                self._fit(trainer, writer, logger, resume_command, config_warnings, t0)
            record = True
        except BaseException as exc:  # noqa: BLE001 - the summary must say how the run ended, then re-raise
            summary.status = A.PREEMPTED if isinstance(exc, KeyboardInterrupt) else A.FAILED
            summary.error = f"{type(exc).__name__}: {exc}".strip()
            record = self.started or (fresh and not isinstance(exc, USER_ERRORS))
            if record:
                _write_quietly(writer.error, f"{summary.error}\n\n{traceback.format_exc()}")
            elif not isinstance(exc, (*USER_ERRORS, KeyboardInterrupt)):
                log.error("%s (the earlier run's files are left as they were)", summary.error, exc_info=True)
            if dist.active:
                A.write_rank_failure(self.run_dir, dist.rank, summary.error, traceback.format_exc())  # first
                self._agree(failed=True)
                _rank_failed(self.run_dir, dist, summary)
            raise
        finally:
            summary.wall_time_s = time.perf_counter() - t0
            if record:
                _write_quietly(writer.summary, summary)
            writer.close()
        return summary

    def _fit(self, trainer: Trainer, writer, logger, resume_command, config_warnings, t0: float) -> None:
        cfg, run_dir, summary, found = self.cfg, self.run_dir, self.summary, self.found
        self.started = True
        if found and self.dist.is_main:
            dropped = R.truncate_rows(run_dir, found[1])
            log.info("resuming %s from %s (rows dropped after its step: %s)", run_dir, found[0].name, dropped)
        elif self.previous is not None and self.dist.is_main:  # an earlier run without a checkpoint
            moved = R.move_aside(run_dir)
            log.warning("no checkpoint to resume from: starting over; the earlier files are in %s", moved)
        summary.backend = trainer.backend.name
        run_json = _run_json(self.config, cfg, trainer, self.previous, found[1] if found else None)
        te_note = te_version_note(run_json["provenance"].get("te_version"))
        if te_note and self.dist.is_main:
            warnings.warn(te_note, ConfigWarning, stacklevel=1)
        run_json["config_warnings"] = config_warnings + ([te_note] if te_note else [])  # kept for the report
        logger.update_config(wandb_config(run_json))  # filterable resolved.* keys (backend that ran, TE)
        writer.write_run({**run_json, "wandb": logger.describe()})
        log.info(
            "run dir %s  (backend=%s, recipe=%s, hardware=%s)",
            run_dir,
            trainer.backend.name,
            cfg.recipe.name,
            cfg.hardware.name,
        )
        if resume_command:
            log.info("to resume this run: %s", resume_command)
            trainer.resume_hint = f"resume with: {resume_command}"
        if trainer.start_step >= cfg.steps:
            summary.status = A.COMPLETED
            log.info("run %s is already complete (step %d)", run_dir, trainer.start_step)
        else:
            _user_code(trainer.fit, summary)
        trainer.finalize(summary)
        self._agree(failed=False)
        summary.wall_time_s = time.perf_counter() - t0
        if summary.status == A.PREEMPTED:
            logger.mark_preempting()
        logger.summary(asdict(summary))
        log.info(A.closing_line(summary, run_dir))

    def _build(self, writer) -> Trainer:
        """The Trainer, with the checkpoint's state when resuming. A ValueError here is the config's
        (a bad data path, vocabulary, recipe; a checkpoint of other data): a ConfigError, exit code 2."""
        try:
            trainer = _user_code(Trainer, self.cfg, self.run_dir, writer, None, self.stop, self.dist)
            if self.found:
                trainer.load_state_dict(self.found[2], self.summary)
            elif self.warm:
                trainer.load_state_dict(self.warm[2], self.summary, warm_from=W.recipe_of(self.warm))
                log.info("warm start from %s (step %d)", self.warm[0], self.warm[1])
        except ValueError as exc:
            raise ConfigError(str(exc)) from exc
        return trainer


def _user_code(fn, *args):
    """Call `fn`, turning a SystemExit (user code such as a quantizer factory calling sys.exit) into
    a failure of this run."""
    try:
        return fn(*args)
    except SystemExit as exc:
        raise UserCodeExit(
            f"sys.exit({exc.code!r}) was called while the run was {'built' if fn is Trainer else 'training'} "
            "(by user code such as recipe.quantizer_factory); code run by the trainer must raise, not exit"
        ) from exc


def te_version_note(version: str | None) -> str | None:
    """The warning for a TE backend running a TE other than the one lowp's emulation reproduces
    (None for that TE, and for the emulated backend, which records no te_version)."""
    if version is None or version == TE_EXACT_VERSION:
        return None
    return (
        f"Transformer Engine {version}: emulated-versus-native comparisons are exact only for "
        f"TE {TE_EXACT_VERSION}, whose numerics lowp's emulated backend reproduces; here they are approximate"
    )


def _write_quietly(write, what) -> None:
    """The failure's record; a run dir that takes no more (full, read-only) leaves it unwritten, with
    a warning, and the failure itself is what the entry point reports."""
    try:
        write(what)
    except OSError as exc:
        log.warning("could not record the failure in the run dir: %s", A.os_error_text(exc))


def _rank_failed(run_dir: Path, dist: D.Dist, summary: Summary) -> None:
    """Several ranks (this rank's failure recorded): name the earliest failing rank in the summary
    (the others' errors are its consequences: a closed connection, a collective's timeout), and
    write summary.json from this rank too unless it is rank 0 (which writes it anyway): the
    launcher may kill rank 0 before it gets there."""
    first = A.first_rank_failure(run_dir) or (dist.rank, summary.error)
    summary.failed_rank = first[0]
    summary.error = f"rank {first[0]} of {dist.world}: {first[1]}"
    if not dist.is_main:
        A.write_json_atomic(
            Path(run_dir) / "summary.json", asdict(summary)
        )  # not RunWriter: it opens metrics


def _run_json(
    config: dict, cfg: Config, trainer: Trainer, previous: dict | None, resumed_from: int | None
) -> dict:
    prov = provenance(
        backend=trainer.backend.describe(),
        hardware=cfg.hardware.name,
        seed=cfg.seed,
        data=trainer.data.describe(),
        device=trainer.device,
    )
    prov.update(
        recipe_label=recipes.label(cfg.recipe),
        init=trainer.init,
        params=trainer.params,
        flops_per_token=trainer.flops_per_token,
        tokens_per_step=trainer.tokens_per_step,
        eval_tokens=trainer.eval_tokens,  # eval_tokens, at most the run's training tokens
        grad_accumulation=trainer.accum,
        parallel=trainer.parallel.describe(),
    )
    objective = trainer.objective.describe()  # masked diffusion: the mask token and where it came from
    if objective:
        prov.update(objective=objective)
    if cfg.backend.deterministic:  # torch's switch and the environment as this run had them
        prov.update(deterministic=determinism.applied())
    if cfg.schedule.phases:  # each phase's first step and full recipe (docs/schedules.md)
        prov.update(schedule=schedule.describe(cfg.recipe, cfg.schedule, cfg.steps))
    attempts = (previous or {}).get("attempts", []) + [R.attempt(resumed_from)]
    return {
        "config": config,
        "provenance": prov,
        "wandb": None,
        "attempts": attempts,
    }

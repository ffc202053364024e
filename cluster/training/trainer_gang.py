"""`TrainerGang`: the one data-parallel trainer world of the job, as one object.

Every group's trainer ranks are ranks of this world (one DeepSpeed engine per rank, one ZeRO
group, one optimizer, gradients all-reduced across groups). The gang fans each call out to all
ranks and waits with a deadline (`trainer.call_timeout_s`): start (actors in the groups'
trainer placement groups, ranks numbered group by group), setup (process group, drafter,
engine, optional resume), fetch and train a step, checkpoint, export, calibrate, and stop.
A resize is stop + start with new placements + setup from the checkpoint just written.
"""

from __future__ import annotations

import logging
import shutil
import time
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING

from cluster.errors import cause_of
from cluster.scaling import Placed
from cluster.training.rank_setup import TrainerSettings
from cluster.training.step_result import StepResult
from cluster.training.trainer_rank import TrainerRank

if TYPE_CHECKING:
    from cluster.data import LeasedSample

log = logging.getLogger("dspark.trainer")


class TrainerFailure(RuntimeError):
    """A call on the world failed: a rank died, hung past the deadline, or raised. The job
    restarts the world from its last checkpoint (a bounded number of times)."""


class TrainerGang:
    def __init__(self, settings: TrainerSettings, run_name: str, env: dict[str, str] | None = None) -> None:
        import ray

        self.ray, self.settings, self.run_name = ray, settings, run_name
        self.env = env  # of every rank's process (CPU: preloaded libraries)
        self.timeout = settings.trainer.call_timeout_s
        self.ranks: list = []
        self.rank_groups: list[str] = []  # group of each rank
        self.generation = 0  # bumped per (re)start: actor names stay unique
        self.threads: int | None = None  # CPU threads each rank runs with (None: what Ray gave it)
        self.one_node = False  # every rank on one node: the world rendezvous and talks on loopback only
        self.init_method: str | None = None  # the current (or last) world's rendezvous

    # ---- fan-out --------------------------------------------------------------------------
    def _wait(self, refs, what: str):
        try:
            return self.ray.get(refs, timeout=self.timeout)
        except self.ray.exceptions.GetTimeoutError:
            raise TrainerFailure(
                f"trainer ranks did not finish {what} within {self.timeout:.0f}s (trainer.call_timeout_s)"
            ) from None
        except self.ray.exceptions.RayActorError as e:
            raise TrainerFailure(f"a trainer rank died during {what}: {cause_of(e)}") from None
        except self.ray.exceptions.RayTaskError as e:
            raise TrainerFailure(f"a trainer rank failed during {what}: {cause_of(e)}") from None

    def _on_all(self, call, what: str) -> list:
        """`call(rank)` (a remote call on that rank's actor) on every rank, in rank order."""
        return self._wait([call(r) for r in self.ranks], what)

    def _on_rank0(self, call, what: str):
        return self._wait(call(self.ranks[0]), what)

    @property
    def size(self) -> int:
        return len(self.ranks)

    def layout(self) -> dict[str, int]:
        """Ranks per group."""
        out: dict[str, int] = {}
        for g in self.rank_groups:
            out[g] = out.get(g, 0) + 1
        return out

    # ---- lifecycle ------------------------------------------------------------------------
    def start(self, placements: list[Placed]) -> None:
        """One actor per bundle of the trainer placement groups (in the order given: group by
        group), then every rank joins the store."""
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        slots = [(p, b) for p in placements for b in p.order]
        world = len(slots)
        self.generation += 1
        self.rank_groups = [p.spec.group for p, _ in slots]
        self.one_node = len({p.bundle_nodes[b] for p, b in slots}) == 1  # (a bundle pins its actor to its node)
        self.ranks = [
            self.ray.remote(TrainerRank)
            .options(
                num_cpus=p.spec.bundles[b].get("CPU", 1),
                num_gpus=p.spec.bundles[b].get("GPU", 0),
                name=f"{self.run_name}-rank{r}.{self.generation}",
                scheduling_strategy=PlacementGroupSchedulingStrategy(p.pg, placement_group_bundle_index=b),
                runtime_env={"env_vars": self.env} if self.env else None,
            )
            .remote(r, world, p.spec.group, self.settings)
            for r, (p, b) in enumerate(slots)
        ]
        self.threads = self.settings.trainer.torch_threads
        self._on_all(lambda r: r.connect_store.remote(), "connect_store")

    def set_threads(self, threads: int | None) -> None:
        """CPU threads per rank from now on (None or unchanged: nothing to do)."""
        if threads and threads != self.threads:
            self._on_all(lambda r: r.set_threads.remote(threads), "set_threads")
            self.threads = threads

    def set_lr_horizon(self, total_steps: int) -> None:
        """The LR schedule ends at `total_steps`, on these ranks and on any world started later."""
        self._on_all(lambda r: r.set_lr_horizon.remote(total_steps), "set_lr_horizon")
        self.settings = replace(self.settings, total_steps=total_steps)

    def setup(self, model_init: dict, resume: Path | None, resized: bool) -> int:
        """Rendezvous at rank 0, build the drafter and engines, load `resume` if given; the step
        the world starts from."""
        stale = self.init_method  # a failed world's, if its rank 0 could not remove it (same node: gone by now or here)
        self.init_method = self._on_rank0(lambda r: r.rendezvous.remote(self.one_node, stale), "rendezvous")
        trainer_dir = str(resume / "trainer") if resume else None
        init = self.init_method
        out = self._on_all(lambda r: r.setup.remote(init, model_init, trainer_dir, resized), "setup")
        log.info(
            "trainer world: %d ranks %s, %d trainable parameters, step %d",
            self.size,
            self.layout(),
            out[0]["params"],
            out[0]["step"],
        )
        return out[0]["step"]

    def stop(self) -> None:
        if self.ranks:
            try:  # rank 0 removes its rendezvous directory (a dead or hung one: the next world's rank 0 does)
                self.ray.get(self.ranks[0].leave.remote(), timeout=10)
                self.init_method = None
            except Exception:  # noqa: BLE001 - stopping anyway
                pass
        for r in self.ranks:
            self.ray.kill(r, no_restart=True)
        self.ranks = []

    # ---- a step ---------------------------------------------------------------------------
    def fetch(self, step: int, lease: list[list[LeasedSample]]) -> dict[str, str]:
        """Every rank reads its share of the step; {uid: why} for samples that cannot be trained."""
        refs = [r.fetch.remote(step, rows) for r, rows in zip(self.ranks, lease)]
        return {uid: why for bad in self._wait(refs, f"reading step {step}") for uid, why in bad.items()}

    def train_step(self, step: int, lease: list[list[LeasedSample]]) -> list[StepResult]:
        """One update of the world on `lease` (already fetched): the ranks weight their losses by
        the world's token count themselves, so ranks without data need no special case."""
        return self._wait([r.train_step.remote(step) for r in self.ranks], f"step {step}")

    # ---- the drafter's full weights on rank 0 ------------------------------------------------
    def calibrate(self, rows: list[LeasedSample], measure_on: list[LeasedSample] = ()) -> dict:
        """Confidence temperatures fitted on `rows` by rank 0, on the world's current weights,
        and the calibration error before and after on `measure_on`."""
        self._gather_full_weights()  # (collective under ZeRO-3, where rank 0 holds a partition)
        return self._on_rank0(lambda r: r.calibrate.remote(rows, list(measure_on)), "calibrate")

    def export(self, dest: str, confidence_temperatures: list[float] | None, verifier: str | None) -> str:
        """Rank 0 writes the drafter (speculators format) to `dest`."""
        self._gather_full_weights()
        return self._on_rank0(lambda r: r.export.remote(dest, confidence_temperatures, verifier), "export")

    # ---- checkpoints ----------------------------------------------------------------------
    def save_checkpoint(self, tmp: Path, dest: Path, step: int, ledger_state: dict, meta: dict) -> Path:
        """Collective save into `tmp`, then rank 0 adds the drafter, ledger and meta and renames
        it to `dest`."""
        shutil.rmtree(tmp, ignore_errors=True)
        rngs = self._on_all(lambda r: r.anchor_rng.remote(), "anchor_rng")
        self._on_all(lambda r: r.save.remote(str(tmp), step, rngs), f"saving the checkpoint of step {step}")
        meta = {**meta, "time": time.time(), "world_size": self.size, "layout": self.layout()}
        self._on_rank0(
            lambda r: r.finalize_checkpoint.remote(str(tmp), str(dest), ledger_state, meta), "finalize_checkpoint"
        )
        return dest

    def _gather_full_weights(self) -> None:
        self._on_all(lambda r: r.gather_full_weights.remote(), "gather_full_weights")

    def parameters_finite(self) -> bool:
        """Every rank's weights (its ZeRO-3 partition) are finite."""
        return all(self._on_all(lambda r: r.parameters_finite.remote(), "parameters_finite"))

    # ---- rank 0's services to the job -----------------------------------------------------
    def remove_keys(self, keys: list[str], abandoned: list[str] = ()) -> int:
        """Drop samples from the store (rank 0 is a store client like any); how many were there.
        `abandoned`: objects of attempts given up on, removed where the store lets them go."""
        return self._on_rank0(lambda r: r.remove_keys.remote(keys, list(abandoned)), "remove_keys")

    def read_drafter(self, drafter_dir: str) -> dict:
        """A checkpointed drafter's config and vocab mapping, what `setup` rebuilds it from."""
        return self._on_rank0(lambda r: r.read_drafter.remote(drafter_dir), "read_drafter")

    def vocab_mapping(self, rows: list[LeasedSample], prompt_texts: list[str]) -> dict:
        """The draft vocabulary counted on the stored samples of `rows` and the prompts' texts."""
        return self._on_rank0(lambda r: r.vocab_mapping.remote(rows, prompt_texts), "vocab_mapping")

    def reconnect_store(self) -> None:
        """Every rank joins the store again (a new master generation)."""
        self._on_all(lambda r: r.reconnect_store.remote(), "reconnect_store")

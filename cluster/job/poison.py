"""Poison samples: a sample that crashes, hangs or runs out of memory the trainer rank that trains
it, found by retrying its step's samples in halves, and quarantined (`PoisonSearch`).

Without it such a sample is never blamed: a trainer restart gives it back to stored, the next
step leases it again, and the world dies again until the restart budget ends the job (and after
every resubmission). A poison prompt is caught on the producers' side (a replica dies on it);
this is the trainer's side.

- The suspects: every sample of the step whose `fetch` or `train_step` the world failed in
  (`TrainerFailure`: a rank died or raised, or hung past `trainer.call_timeout_s`, the gang's
  deadline on every call: a hang is a failure like a death). All ranks' samples, not the dead
  rank's: the ranks run collectives, so one rank's death fails the others' calls too and the
  first error Ray returns need not be the dead rank's. A failure anywhere else (setup, a
  checkpoint, a resize) holds no sample and starts no search.
- The search: after the world's restart (from the last checkpoint, as any failure), the steps
  hold only suspects, nothing else is leased until it ends (`SampleLedger.lease_only`):
  one half of them; a step that trains clears its half (it is trained, as any step) and the
  other half stays suspect; a step that fails narrows the suspects to its half and the other
  half goes back to the ledger's queue (leased as usual once the search ends). A suspect that
  fails alone is the poison: `SampleLedger.quarantine_sample` fails it and its prompt in every
  epoch (as a poison prompt's copies). The next checkpoint's ledger state carries that across a
  resubmission (a stop's and the end's checkpoints too; a crash before it loses it, and the
  sample is found again). If every suspect trains, the failure is not reproduced: it was not
  the data (an event says so) and nothing is quarantined.
- A broken world, not a sample: a suspect that failed alone before any step of the search
  trained is only blamed once the world trains a step without it (the control: the samples set
  aside, or others stored); a control that fails too ends the job with a message naming the
  world (a node, a GPU, its driver), and no sample is quarantined.
- Bounds: the step's first failure spends the trainer's `RestartBudget` as any failure does;
  the search's own failures do not (a poison sample must not end the job by exhausting it
  while it is being found), since the search bounds them: each failure halves the suspects,
  so at most ceil(log2 n) for a step of n samples (3 for 8: with the first, 3 + 1 restarts),
  then one control, whose failure ends the job. A restart that fails itself spends the budget
  as ever.
- What is said: each test's outcome and the verdict in the `EventLog` (result.json's events);
  the poison sample in result.json's `poison_samples` (its uid, its prompt, the step and the
  rank's error it failed alone with, its quarantined copies) beside the poison prompts'
  `quarantined`, where its prompt is listed too when it has other epochs.

A job stopped or killed mid-search loses the search (it lives in the driver): the suspects are
leased again and found again. A failure of the world during the search that is not the data's
(a transient death) may blame the one suspect it strikes alone; that is one sample, and the
control keeps a world that fails on everything from blaming any.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

POISON, NOT_REPRODUCED, BROKEN_WORLD, GONE = "poison", "not_reproduced", "broken_world", "gone"


@dataclass(frozen=True)
class Verdict:
    kind: str  # POISON | NOT_REPRODUCED | BROKEN_WORLD | GONE
    message: str  # for the EventLog, or the job's end (BROKEN_WORLD)
    uid: str | None = None  # POISON: the sample
    cause: str | None = None  # POISON: what the ledger keeps as its error (the step, the rank's error)


class PoisonSearch:
    """The search's state, driven by the training loop: `start` (a step failed), then for each
    test step `next_test` (the samples it holds; [] when a control is due and none is set
    aside), `tested` (what the ledger could lease of them), and `passed` or `failed`; the call
    that ends the search returns its `Verdict`. Pure: no ledger, no world (the soak drives it
    too, and both lease through `lease_test`)."""

    def __init__(self) -> None:
        self.origin: tuple[int, int, str] | None = None  # (the failed step, its samples, the error): active
        self.suspects: list[str] = []  # one of them is thought to kill the world
        self.aside: list[str] = []  # cleared by another half's failure, not tested: the control's samples
        self.culprit: tuple[str, int, str] | None = None  # (uid, step, error): failed alone, awaiting the control
        self.trained = False  # a step of the search trained: the world can train
        self.failures = 0  # the search's test steps that failed

    def active(self) -> bool:
        return self.origin is not None

    def bound(self) -> int:
        """The test steps that can fail before the verdict (each halves the suspects; the
        control's failure, one more, ends the job)."""
        return max(1, math.ceil(math.log2(self.origin[1]))) if self.origin else 0

    def start(self, step: int, uids: list[str], cause: str) -> str:
        """The world failed in step `step` holding `uids`: they are the suspects."""
        self.origin, self.suspects, self.aside = (step, len(uids), cause), list(uids), []
        self.culprit, self.trained, self.failures = None, False, 0
        return (
            f"step {step}: the trainer world failed with {len(uids)} samples in it ({cause}); "
            f"their steps are retried in halves to find a poison sample among them (at most "
            f"{self.bound()} more failures, outside trainer.max_restarts)"
        )

    def next_test(self) -> list[str]:
        """The samples the next step holds: half the suspects, the one left alone, or the control."""
        if self.culprit is not None:
            return list(self.aside)
        return self.suspects[: max(1, len(self.suspects) // 2)]

    def tested(self, asked: list[str], leased: list[str]) -> Verdict | None:
        """The ledger leased `leased` of `asked`: the others are no longer stored (given back to
        be generated again, e.g. read as gone): out of the search."""
        gone = set(asked) - set(leased)
        self.suspects = [u for u in self.suspects if u not in gone]
        self.aside = [u for u in self.aside if u not in gone]
        if self.culprit is not None and not leased:
            uid, step, cause = self.culprit
            return self._poison(uid, step, cause, "no other sample was stored to try the world on without it")
        if self.culprit is None and not self.suspects:
            step = self.origin[0]
            return self._end(GONE, f"step {step}'s suspects are no longer stored (generated again): the search ends")
        return None

    def passed(self, step: int, uids: list[str]) -> Verdict | None:
        self.trained = True
        if self.culprit is not None:
            uid, at, cause = self.culprit
            return self._poison(uid, at, cause, f"the world trained step {step} without it")
        self.suspects = [u for u in self.suspects if u not in uids]
        self.aside = [u for u in self.aside if u not in uids]
        if not self.suspects:
            origin, n, cause = self.origin
            return self._end(
                NOT_REPRODUCED,
                f"step {origin}'s failure ({cause}) did not happen again with any of its {n} samples: "
                f"not a poison sample",
            )
        return None

    def failed(self, step: int, uids: list[str], cause: str) -> Verdict | None:
        self.failures += 1
        if self.culprit is not None:
            uid, at, first = self.culprit
            origin, n, _ = self.origin
            return self._end(
                BROKEN_WORLD,
                f"the trainer world fails whatever its samples: it failed at step {origin} ({n} samples), "
                f"at step {at} on {uid} alone ({first}) and at step {step} on {len(uids)} other samples without "
                f"it: a broken node, GPU or driver, not a poison sample; last: {cause}",
            )
        if len(uids) == 1:
            if self.trained:
                return self._poison(uids[0], step, cause, "its step's other samples trained")
            self.aside += [u for u in self.suspects if u not in uids]
            self.culprit, self.suspects = (uids[0], step, cause), []
            return None
        self.aside += [u for u in self.suspects if u not in uids]
        self.suspects = [u for u in self.suspects if u in uids]
        return None

    def _poison(self, uid: str, step: int, cause: str, confirmed: str) -> Verdict:
        pid = uid.rsplit("@", 1)[0]
        why = f"the trainer world failed on it alone at step {step}: {cause}"
        return self._end(
            POISON,
            f"poison sample {uid} (prompt {pid}) quarantined in every epoch: {why} ({confirmed})",
            uid,
            why,
        )

    def _end(self, kind: str, message: str, uid: str | None = None, cause: str | None = None) -> Verdict:
        self.origin, self.suspects, self.aside, self.culprit = None, [], [], None
        return Verdict(kind, message, uid, cause)


def lease_test(search: PoisonSearch, ledger, step: int, rank_groups: list[str], batch_tokens: int):
    """While `search` is on, step `step`'s lease: its next test's samples, or for a control with
    none set aside, another stored one (`ledger.peek_stored`). Returns (the lease, the verdict of
    a search that ended for want of anything to lease); (None, ...) once the search is off: the
    step is leased as usual. Each round that leases nothing drops suspects or ends the search."""
    verdict = None
    while search.active():
        uids = search.next_test()
        if not uids and search.culprit is not None:
            uids = [row.uid for row in ledger.peek_stored(2) if row.uid != search.culprit[0]][:1]
        lease = ledger.lease_only(step, uids, rank_groups, batch_tokens) if uids else None
        leased = [row.uid for rows in lease or () for row in rows]
        verdict = search.tested(uids, leased)
        if leased:
            return lease, None
    return None, verdict

"""`SampleLedger`: where every prompt of every epoch is, so none is lost or trained twice.

    pending ──► generating(replica) ──► stored(key) ──► leased(step, rank) ──► trained
       ▲              │ dies / fails         │ master restart       │ trainer restart
       └──────────────┴──────────────────────┘◄─────────────────────┘ (leased → stored)

- Inference replicas ask for prompts (`request_prompts`) and report what they stored.
- The trainer leases one step's worth of samples for all data-parallel ranks at once
  (`lease_step`, token-balanced) and commits at checkpoints: `checkpoint_state(step)` is
  saved *inside* the checkpoint, then `commit(step)` marks the samples trained and hands back
  their keys for removal. A crash between the two loses nothing: the checkpoint already says
  trained, and the live ledger is reset from it on resume.
- Recovery: `replica_died` (generating → pending), `master_restarted` (stored samples are
  gone with the store → pending; a lease whose data the trainer can no longer read comes back
  through `release_lease`), `trainer_restarted` (leased after the last commit → stored,
  re-leased as is).
- Backpressure: producers are told to pause once stored-but-untrained bytes pass the high
  watermark and resume under the low one.

A prompt is trained once per epoch: the entry id is `prompt_id@epoch`, and epoch e+1 is not
handed out before epoch e has nothing left to generate. Nor is it leased before every sample of
epoch e has been: a trainer faster than its replicas would otherwise run through each new
sample's later epochs back to back (with reuse they are stored at once), which is training on
a few recent samples over and over instead of on epochs (measured on the local job: held-out
τ 1.46–1.52 that way, 1.66–1.68 with the wait, same steps). The one exception is a full store:
when producers are paused, later epochs are leased too, since training them is what frees the
space. Epochs after the first go through the prompts in a seeded shuffled order.
"""

from __future__ import annotations

import random
import time
from collections import Counter
from dataclasses import asdict, dataclass, field

PENDING, GENERATING, STORED, LEASED, TRAINED, FAILED = "pending", "generating", "stored", "leased", "trained", "failed"
STATES = (PENDING, GENERATING, STORED, LEASED, TRAINED, FAILED)


@dataclass
class Entry:
    prompt_id: str
    epoch: int
    state: str = PENDING
    replica: str | None = None
    ref: dict | None = None  # SampleRef fields once stored
    tokens: int = 0
    nbytes: int = 0
    step: int | None = None
    rank: int | None = None
    since: float = 0.0  # when the current state began
    attempts: int = 0
    errors: list[str] = field(default_factory=list)
    trained_at_step: int | None = None

    @property
    def uid(self) -> str:
        return f"{self.prompt_id}@{self.epoch}"


class LedgerError(RuntimeError):
    pass


def balance(items: list[tuple[str, int]], parts: int) -> list[list[str]]:
    """Split (uid, tokens) into `parts` lists with near-equal token sums (largest first)."""
    bins: list[list[str]] = [[] for _ in range(parts)]
    loads = [0] * parts
    for uid, tokens in sorted(items, key=lambda x: -x[1]):
        i = loads.index(min(loads))
        bins[i].append(uid)
        loads[i] += tokens
    return bins


class SampleLedger:
    def __init__(
        self,
        group: str,
        prompts: list[dict],
        epochs: int = 1,
        key_prefix: str = "run",
        high_watermark_bytes: int = 1 << 62,
        low_watermark_bytes: int = 1 << 61,
        max_attempts: int = 3,
        clock=time.monotonic,
        reuse_across_epochs: bool = False,
        shuffle_seed: int = 0,
    ) -> None:
        ids = [p["id"] for p in prompts]
        if len(set(ids)) != len(ids):
            dup = [k for k, n in Counter(ids).items() if n > 1][:5]
            raise LedgerError(f"prompt ids must be unique; duplicated: {dup}")
        self.group, self.key_prefix, self.epochs = group, key_prefix, epochs
        self.messages = {p["id"]: p["messages"] for p in prompts}
        self.entries: dict[str, Entry] = {}
        self.order: list[str] = []
        for e in range(epochs):
            # Epoch 0 runs in generation order; later ones reshuffle (deterministically, so a
            # resumed job sees the same order).
            order = ids if e == 0 else random.Random(f"{shuffle_seed}/{e}").sample(ids, len(ids))
            for pid in order:
                entry = Entry(pid, e)
                self.entries[entry.uid] = entry
                self.order.append(entry.uid)
        self.high, self.low = high_watermark_bytes, low_watermark_bytes
        self.max_attempts = max_attempts
        self.clock = clock
        # With deterministic (greedy) regeneration, epoch e+1 would produce the very same sample:
        # keep it in the store and hand it to the next epoch instead of regenerating it.
        self.reuse = reuse_across_epochs
        self.paused = False
        self.master_generation = 0
        self.committed_step = 0
        self.events: list[dict] = []  # recoveries and failures, for the job log and tests
        self.totals = Counter()  # produced/trained samples and tokens since start

    # ---- helpers -----------------------------------------------------------------------
    def _set(self, e: Entry, state: str, **fields) -> None:
        e.state, e.since = state, self.clock()
        for k, v in fields.items():
            setattr(e, k, v)

    def _in(self, *states: str) -> list[Entry]:
        return [self.entries[u] for u in self.order if self.entries[u].state in states]

    def key_for(self, e: Entry) -> str:
        # attempt in the key: a regenerated sample never aliases a stale object
        return f"{self.key_prefix}/{self.group}/{e.prompt_id}@{e.epoch}.{e.attempts}"

    def queued_bytes(self) -> int:
        """Bytes held in the store for untrained samples; a reused sample (its lease and its next
        epoch's entry share one key) counts once."""
        held = {(e.ref or {}).get("key", e.uid): e.nbytes for e in self._in(STORED, LEASED)}
        return sum(held.values())

    def _update_pause(self) -> None:
        q = self.queued_bytes()
        if not self.paused and q >= self.high:
            self.paused = True
        elif self.paused and q <= self.low:
            self.paused = False

    def current_epoch(self) -> int:
        """The lowest epoch that still has prompts to generate."""
        for u in self.order:
            e = self.entries[u]
            if e.state in (PENDING, GENERATING):
                return e.epoch
        return self.epochs

    def lease_epoch(self) -> int:
        """The lowest epoch with a sample not yet leased: later epochs wait for it."""
        for u in self.order:
            e = self.entries[u]
            if e.state in (PENDING, GENERATING, STORED):
                return e.epoch
        return self.epochs

    # ---- producers ---------------------------------------------------------------------
    def request_prompts(self, replica: str, max_n: int) -> list[dict]:
        """Up to `max_n` prompts for a replica; [] while paused by backpressure."""
        self._update_pause()
        if self.paused:
            return []
        epoch = self.current_epoch()
        out = []
        for e in self._in(PENDING):
            if len(out) >= max_n or (e.epoch > epoch and not self.reuse):
                break
            if self.reuse and e.epoch > 0 and self.entries[f"{e.prompt_id}@{e.epoch - 1}"].state not in (TRAINED, FAILED):
                continue  # it inherits the previous epoch's sample once that one is leased
            e.attempts += 1
            self._set(e, GENERATING, replica=replica)
            out.append({"id": e.prompt_id, "uid": e.uid, "key": self.key_for(e), "messages": self.messages[e.prompt_id]})
        return out

    def report_produced(self, replica: str, results: list[dict]) -> None:
        """`results`: {"uid", "ref" or "error", "tokens", "nbytes"} per prompt handed out."""
        for r in results:
            e = self.entries.get(r["uid"])
            if e is None or e.state != GENERATING or e.replica != replica:
                # A late report for a prompt already returned to pending (replica declared dead):
                # ignore it, the prompt is being regenerated elsewhere.
                self.events.append({"event": "stale_report", "uid": r["uid"], "replica": replica})
                continue
            if r.get("error") or not r.get("ref"):
                e.errors.append(str(r.get("error")))
                if e.attempts >= self.max_attempts:
                    self._set(e, FAILED, replica=None)
                    self.events.append({"event": "failed", "uid": e.uid, "errors": e.errors})
                else:
                    self._set(e, PENDING, replica=None)
                continue
            self._set(e, STORED, ref=r["ref"], tokens=int(r["tokens"]), nbytes=int(r["nbytes"]), replica=None)
            self.totals["produced_samples"] += 1
            self.totals["produced_tokens"] += int(r["tokens"])
        self._update_pause()

    def replica_died(self, replica: str) -> int:
        lost = [e for e in self._in(GENERATING) if e.replica == replica]
        for e in lost:
            self._set(e, PENDING, replica=None)
        self.events.append({"event": "replica_died", "replica": replica, "returned": len(lost)})
        return len(lost)

    # ---- trainer -----------------------------------------------------------------------
    def peek_stored(self, n: int) -> list[dict]:
        """Up to `n` stored samples, without leasing them (e.g. to fit a vocab mapping)."""
        return [{"uid": e.uid, "ref": e.ref} for e in self._in(STORED)[:n]]

    def lease_step(self, step: int, world_size: int, batch_tokens: int) -> list[list[dict]] | None:
        """Samples for optimizer step `step`, one list per rank, token-balanced; None when
        nothing is stored yet. Re-asking for a step already leased returns the same lease."""
        held = [e for e in self._in(LEASED) if e.step == step]
        if not held:
            budget = batch_tokens * world_size
            chosen, total = [], 0
            floor = self.epochs if self.paused else self.lease_epoch()
            for e in self._in(STORED):  # epoch-major
                if e.epoch > floor or (chosen and total + e.tokens > budget):
                    break
                chosen.append(e)
                total += e.tokens
            if not chosen:
                return None
            for e in chosen:
                self._set(e, LEASED, step=step)
                nxt = self._next_epoch(e)
                if nxt is not None:  # reuse: the next epoch may train on this sample from now on
                    self._set(nxt, STORED, ref=e.ref, tokens=e.tokens, nbytes=e.nbytes)
            held = chosen
        parts = balance([(e.uid, e.tokens) for e in held], world_size)
        out = []
        for rank, uids in enumerate(parts):
            rows = []
            for u in uids:
                self.entries[u].rank = rank
                rows.append({"uid": u, "ref": self.entries[u].ref})
            out.append(rows)
        return out

    def checkpoint_state(self, step: int) -> dict:
        """The ledger as it will be once `step` is committed, to save inside the checkpoint."""
        state = self.state_dict()
        for d in state["entries"]:
            if d["state"] == LEASED and d["step"] is not None and d["step"] <= step:
                d.update(state=TRAINED, trained_at_step=d["step"])
        state["committed_step"] = step
        return state

    def _next_epoch(self, e: Entry) -> Entry | None:
        nxt = self.entries.get(f"{e.prompt_id}@{e.epoch + 1}")
        return nxt if self.reuse and nxt is not None and nxt.state == PENDING else None

    def _shares_key_with_next(self, e: Entry) -> bool:
        nxt = self.entries.get(f"{e.prompt_id}@{e.epoch + 1}")
        return bool(self.reuse and nxt is not None and nxt.ref and nxt.ref.get("key") == e.ref["key"]
                    and nxt.state in (STORED, LEASED))

    def commit(self, step: int) -> list[str]:
        """Mark everything leased up to `step` trained; return the keys the store can drop
        (a sample the next epoch still uses keeps its key)."""
        keys = []
        for e in self._in(LEASED):
            if e.step is not None and e.step <= step:
                self._set(e, TRAINED, trained_at_step=e.step)
                if not self._shares_key_with_next(e):
                    keys.append(e.ref["key"])
                self.totals["trained_samples"] += 1
                self.totals["trained_tokens"] += e.tokens
        self.committed_step = max(self.committed_step, step)
        self._update_pause()
        return keys

    def trainer_restarted(self, committed_step: int) -> int:
        back = [e for e in self._in(LEASED) if e.step is None or e.step > committed_step]
        for e in back:
            self._set(e, STORED, step=None, rank=None)
        self.events.append({"event": "trainer_restarted", "committed_step": committed_step, "re_leased": len(back)})
        return len(back)

    def release_lease(self, step: int, missing: list[str]) -> None:
        """The trainer could not read step `step`'s data: the `missing` samples are gone from the
        store (back to pending, to be regenerated), the rest go back to stored."""
        gone = set(missing)
        for e in self._in(LEASED):
            if e.step == step:
                if e.uid in gone:
                    self._set(e, PENDING, ref=None, step=None, rank=None, nbytes=0)
                else:
                    self._set(e, STORED, step=None, rank=None)
        self.events.append({"event": "lease_released", "step": step, "missing": len(gone)})
        self._update_pause()

    def master_restarted(self, generation: int) -> int:
        """A new master generation has no keys: stored samples must be regenerated.

        Leased samples stay leased: if the trainer already read them they are in the model and
        only await their commit; if it had not, its read fails and `release_lease` returns them.
        """
        if generation <= self.master_generation:
            return 0
        self.master_generation = generation
        lost = self._in(STORED)
        for e in lost:
            self._set(e, PENDING, ref=None, step=None, rank=None, nbytes=0)
        self.events.append({"event": "master_restarted", "generation": generation, "returned": len(lost)})
        self._update_pause()
        return len(lost)

    # ---- accounting --------------------------------------------------------------------
    def counts(self) -> dict:
        c = Counter(e.state for e in self.entries.values())
        now = self.clock()
        leases = [now - e.since for e in self._in(LEASED)]
        return {
            **{s: c.get(s, 0) for s in STATES},
            "total": len(self.entries),
            "queued_bytes": self.queued_bytes(),
            "paused": self.paused,
            "oldest_lease_s": max(leases) if leases else 0.0,
            "epoch": self.current_epoch(),
            "to_generate": self.to_generate(),
            **dict(self.totals),
        }

    def to_generate(self) -> int:
        """Samples still to be generated (with reuse, a later epoch's pending entry is not one
        unless its previous epoch ended without a sample it could inherit)."""
        n = 0
        for e in self.entries.values():
            if e.state == GENERATING:
                n += 1
            elif e.state == PENDING and (not self.reuse or e.epoch == 0 or
                                         self.entries[f"{e.prompt_id}@{e.epoch - 1}"].state in (TRAINED, FAILED)):
                n += 1
        return n

    def done(self) -> bool:
        return all(e.state in (TRAINED, FAILED) for e in self.entries.values())

    def drained(self) -> bool:
        """Nothing left to generate or store: what remains is leased or final."""
        return not self._in(PENDING, GENERATING, STORED)

    def verify_exactly_once(self) -> dict:
        """Every prompt of every epoch trained exactly once (failures listed, never hidden)."""
        trained = [e.uid for e in self.entries.values() if e.state == TRAINED]
        failed = [e.uid for e in self.entries.values() if e.state == FAILED]
        other = [e.uid for e in self.entries.values() if e.state not in (TRAINED, FAILED)]
        if len(set(trained)) != len(trained):
            raise LedgerError("a sample was trained twice")
        if other:
            raise LedgerError(f"{len(other)} samples neither trained nor failed, e.g. {other[:5]}")
        per_epoch = Counter(u.rsplit("@", 1)[1] for u in trained)
        return {"trained": len(trained), "failed": failed, "per_epoch": dict(per_epoch),
                "expected_per_epoch": len(self.messages)}

    def state_dict(self) -> dict:
        return {
            "group": self.group, "epochs": self.epochs, "committed_step": self.committed_step,
            "master_generation": self.master_generation, "totals": dict(self.totals),
            "entries": [asdict(self.entries[u]) for u in self.order],
        }

    def load_state_dict(self, state: dict, master_generation: int | None = None) -> list[str]:
        """Restore after a restart. Only `trained` (and `failed`) survive: anything in flight
        goes back to pending, since the replicas and leases it referred to are gone.

        Returns the keys the saved state referenced, which may still linger in the store
        (stored before the crash, or trained but not yet removed): the caller removes them.
        """
        known = {f"{d['prompt_id']}@{d['epoch']}": d for d in state["entries"]}
        stale = [d["ref"]["key"] for d in state["entries"] if d.get("ref")]
        for uid, e in self.entries.items():
            d = known.get(uid)
            if d and d["state"] in (TRAINED, FAILED):
                self._set(e, d["state"], trained_at_step=d.get("trained_at_step"), tokens=d.get("tokens", 0),
                          attempts=d.get("attempts", 0), errors=list(d.get("errors", [])), ref=d.get("ref"))
            else:
                self._set(e, PENDING, ref=None, step=None, rank=None, nbytes=0, replica=None,
                          attempts=d.get("attempts", 0) if d else 0)
        self.committed_step = state.get("committed_step", 0)
        self.totals = Counter(state.get("totals", {}))
        if master_generation is not None:
            self.master_generation = master_generation
        self._update_pause()
        return stale

"""What the ledger reports about itself (`SampleLedger.counts`): typed, as it crosses Ray."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class Totals:
    """Produced and trained since the job started (or the checkpoint it resumed from)."""

    produced_samples: int = 0
    produced_tokens: int = 0
    produced_bytes: int = 0
    trained_samples: int = 0
    trained_tokens: int = 0
    crossed_samples: int = 0  # trained by a rank of another group than the one that generated it


@dataclass(frozen=True)
class GroupCounts(Totals):
    """One group: what it generates and holds in the store, and what it produced and got trained."""

    generating: int = 0
    stored: int = 0
    leased: int = 0
    queued_bytes: int = 0
    paused: bool = False


@dataclass(frozen=True)
class LedgerCounts(GroupCounts):
    """Job-wide: what a group's counts say, for all groups together, and samples per state, the
    plan; `groups` per group."""

    pending: int = 0
    trained: int = 0
    failed: int = 0
    total: int = 0
    oldest_lease_s: float = 0.0
    epoch: int = 0
    epochs: int = 0
    to_generate: int = 0
    groups: dict[str, GroupCounts] = field(default_factory=dict)

    def per_state(self) -> dict[str, int]:
        """Samples per state, by the states' names (as the metrics are named)."""
        return {
            "pending": self.pending,
            "generating": self.generating,
            "stored": self.stored,
            "leased": self.leased,
            "trained": self.trained,
            "failed": self.failed,
        }

    def group(self, name: str) -> GroupCounts:
        """The group's counts; zeros for a group the ledger has not heard of yet."""
        return self.groups.get(name, GroupCounts())

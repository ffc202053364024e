"""`Supervisor`: between steps, the producers and the store are looked after: dead replicas are
replaced (each pool's bounded budget), and after a Mooncake master restart (a new generation)
the samples it held go back to pending and the ranks join the new master."""

from __future__ import annotations

import logging

from cluster.data import LedgerClient
from cluster.job.events import EventLog
from cluster.store import StoreServices
from cluster.training import TrainerGang


class Supervisor:
    def __init__(
        self, services: StoreServices, pools: dict, ledger: LedgerClient, gang: TrainerGang, events: EventLog
    ) -> None:
        self.services, self.pools, self.ledger, self.gang, self.events = services, pools, ledger, gang, events
        self.master_generation = services.master_info()["generation"]  # the master the ledger's samples are in

    def check(self) -> None:
        gen = self.services.check()
        if gen > self.master_generation:
            self.master_generation = gen
            lost = self.ledger.master_restarted(gen)
            self.events.add(
                f"master restarted (generation {gen}): {lost} stored samples back to pending", logging.WARNING
            )
            self.gang.reconnect_store()
        for pool in self.pools.values():
            pool.supervise()

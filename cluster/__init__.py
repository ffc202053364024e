"""The Ray side of dspark-cluster, in rooms by role (see docs/rooms.md for the map):

    store/      the samples' bytes: wire format, store client, Mooncake daemons
    data/       what is trained, exactly once: prompts, ledger and its rows, training record
    scaling/    how capacity is laid out and moved: policy, autoscaler, placement, capacity plan
    inference/  the target serving and extracting: replica actor, capture model, vLLM connector,
                producers (the replay one too), replica pool, served evaluation
    training/   the drafter learning: trainer rank, trainer gang, epoch budget, checkpoints
    box/        one CPU box's plan before the job: the pure plan, the probe, the kept paces
    job/        one config's whole run: the training job, its progress reporter

The ground floor (config and its data, fields, checks and loading, errors, hardware, metrics,
control, waiting, preflight, target) is shared by every room and imports none. The rooms stand
on floors, each importing only those below it:

    ground floor -> store, scaling -> data -> inference, training, box -> job

A room imports another room's public names from its `__init__`, never its modules;
tests/unit/test_rooms.py reads every import and fails on a circle between rooms, on a reach
into another room's module, and on a ground-floor module that imports a room.
"""

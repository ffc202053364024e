"""The Ray side of dspark-cluster, in rooms by role (see docs/rooms.md for the map):

    store/      the samples' bytes: wire format, store client, Mooncake daemons, vLLM connector
    data/       what is trained, exactly once: prompts, ledger, training record, replay
    inference/  the target serving and extracting: replica actor, capture model, replica pool
    training/   the drafter learning: trainer rank, trainer gang, epoch budget, checkpoints
    scaling/    how capacity is laid out and moved: policy, autoscaler, placement, capacity plan
    job/        one config's whole run: the training job, its progress reporter

config (its checks in config_checks), errors, hardware, metrics, control and waiting (the one
wait helper) sit at the top: every room uses them. A room
imports another room's public names from its `__init__`, never its modules.
"""

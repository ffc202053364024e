"""The runtime environment scripts/run_local.sh submits the job with, as JSON: what the working
directory upload leaves out, the environment of the job's processes, and the job's own arguments
(its config and overrides, given here) in $DSPARK_JOB_ARGS.

    python scripts/runtime_env.py --config configs/local.yaml output_dir=/abs/outputs key=value ...

The arguments travel in the environment, not in the entrypoint: `ray job submit` runs its
entrypoint through a shell (`/bin/sh -c`), where a `$`, `;` or quote in an override would be the
shell's to read; an environment variable reaches `jobs/train_kimi_k3.py` as written.
"""

from __future__ import annotations

import json
import os
import sys


def runtime_env(job_args: list[str], environ=os.environ) -> dict:
    cache = environ["DSPARK_CACHE"]
    return {
        "excludes": [".git", ".venv", "outputs", ".cache", "**/__pycache__", "*.egg-info"],
        "env_vars": {
            "DSPARK_CACHE": cache,
            "TORCH_EXTENSIONS_DIR": environ.get("TORCH_EXTENSIONS_DIR", cache + "/torch_extensions"),
            "WANDB_MODE": "offline",
            "TOKENIZERS_PARALLELISM": "false",
            "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
            "VLLM_CPU_KVCACHE_SPACE": "1",
            "MC_STORE_MEMCPY": "0",
            "PYTHONUNBUFFERED": "1",
            "GLOG_minloglevel": "2",
            # `ray job stop` kills the driver this long after its SIGTERM (Ray's default: 3 s), time
            # for the stop's checkpoint and result.json (jobs/train_kimi_k3.py)
            "RAY_JOB_STOP_WAIT_TIME_S": "120",
            "DSPARK_JOB_ARGS": json.dumps(job_args),  # read by jobs/train_kimi_k3.py (job_arguments)
        },
    }


if __name__ == "__main__":
    print(json.dumps(runtime_env(sys.argv[1:])))

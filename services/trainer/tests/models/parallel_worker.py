"""Run by hf_parity.run_expert_and_context_parallel under torchrun: a family's expert-parallel run
(ep_worker.py, ep=2) and then its context-parallel run (cp_worker.py, cp=2) in the same 2 ranks,
each in a process group of its own, so that a family pays one start of the ranks (torchrun, the
interpreters, their imports), not two.

The second group meets on a store of its own: a group made again on torchrun's store after
destroy_process_group restarts torch's group numbering, finds the first group's keys there and
can hang on them.

    torchrun --standalone --nproc-per-node 2 parallel_worker.py MODEL_DIR EP_BATCHES EP_OUT CP_DATA CP_OUT
"""

import argparse
import os
import pathlib
import socket
import sys
from datetime import timedelta

import torch.distributed as dist

# ep_worker, cp_worker and their tiny_training live one folder up.
sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

import cp_worker
import ep_worker


def use_a_new_store() -> None:
    """Point the next init_process_group at a store rank 0 serves on a free port, agreed on
    through torchrun's store."""
    agent_store = dist.TCPStore(
        os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False, timeout=timedelta(seconds=300)
    )
    if os.environ["RANK"] == "0":
        with socket.socket() as probe:
            probe.bind((os.environ["MASTER_ADDR"], 0))
            agent_store.set("parallel_worker/cp_port", str(probe.getsockname()[1]))
    os.environ["MASTER_PORT"] = agent_store.get("parallel_worker/cp_port").decode()
    os.environ["TORCHELASTIC_USE_AGENT_STORE"] = "False"


def main(model_dir: str, ep_batches: str, ep_out: str, cp_data: str, cp_out: str) -> None:
    ep_worker.main(pathlib.Path(model_dir), pathlib.Path(ep_batches), pathlib.Path(ep_out), 2)
    use_a_new_store()
    cp_worker.main(
        argparse.Namespace(
            model_dir=pathlib.Path(model_dir),
            data_file=pathlib.Path(cp_data),
            out_dir=pathlib.Path(cp_out),
            cp=2,
            ep=1,
            dtype="float64",
            compute_dtype=None,
            attn_backend="sdpa",
            compile=False,
        )
    )


if __name__ == "__main__":
    main(*sys.argv[1:6])

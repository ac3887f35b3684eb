"""Two nodes simulated on this machine: two launchers on loopback, each starting its own processes, one job.

Node 0 runs trainer ranks 0-1, node 1 runs trainer rank 2 and the generator (rank 3): the trainer world and
the weight transfer both cross the node boundary. Everything is set up from the launcher's rendezvous alone.
"""

import os
import subprocess
import sys

import pytest

from conftest import REPO, SCRIPTS, assert_on_policy, free_port, step_logs, trained_rows

pytestmark = pytest.mark.slow


def launch_nodes(launcher: str, nodes: int, per_node: int, script_args: list[str]) -> list[subprocess.Popen]:
    port = free_port()
    procs = []
    for node in range(nodes):
        if launcher == "torchrun":
            cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes", str(nodes), "--node_rank", str(node),
                   "--nproc_per_node", str(per_node), "--master_addr", "127.0.0.1", "--master_port", str(port)]
        else:
            cmd = [sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu", "--num_machines", str(nodes),
                   "--machine_rank", str(node), "--num_processes", str(nodes * per_node),
                   "--main_process_ip", "127.0.0.1", "--main_process_port", str(port)]
        env = dict(os.environ)
        for key in ("WORLD_SIZE", "RANK", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
            env.pop(key, None)
        procs.append(subprocess.Popen(cmd + script_args, cwd=str(REPO), env=env, text=True,
                                      stdout=subprocess.PIPE, stderr=subprocess.PIPE))
    return procs


def test_two_nodes_train_and_the_generator_ends_with_the_trainers_weights(tiny_model, tmp_path):
    """The same job launched by torchrun and by accelerate launch, side by side."""
    from hfllamarl.runtime.data.prompts import batch_rows

    jobs = {}
    for launcher in ("torchrun", "accelerate"):
        out = str(tmp_path / launcher)
        jobs[launcher] = (out, launch_nodes(launcher, 2, 2, [str(SCRIPTS / "train_tiny.py"), tiny_model, out,
                                                             "--steps", "3", "--max-staleness", "0",
                                                             "--report-to", "none"]))
    results = {}
    try:
        for launcher, (_, procs) in jobs.items():
            results[launcher] = [proc.communicate(timeout=600) for proc in procs]
    finally:
        for _, procs in jobs.values():
            for proc in procs:
                proc.kill()
    for launcher, (out, procs) in jobs.items():
        for node, (proc, (stdout, stderr)) in enumerate(zip(procs, results[launcher])):
            assert proc.returncode == 0, \
                f"{launcher}: node {node} exited {proc.returncode}\n{stdout[-3000:]}\n{stderr[-5000:]}"
        steps = step_logs(results[launcher][0][0])
        assert [h["step"] for h in steps] == [1, 2, 3], launcher
        for h in steps:
            # Synchronous: the generator on node 1 samples every batch with exactly the weights the three trainer
            # ranks (two of them on node 0) hold, so pi/mu is 1 on every token, the last step included.
            assert h["staleness/max"] == 0
            assert_on_policy(h)
        rows = [trained_rows(out, r) for r in range(3)]
        for step in (1, 2, 3):  # 3 trainer ranks x 16 completions / 4 per prompt = 12 prompts per step
            assert sorted(rows[0][step] + rows[1][step] + rows[2][step]) == \
                sorted(batch_rows(64, 12, step - 1, seed=0)), (launcher, step)


def test_two_replicas_of_tensor_parallel_two_one_per_node(tiny_model, tmp_path):
    """2 nodes x 3 processes: node 0 runs trainer ranks 0-1 and replica 0 (ranks 2-3, vLLM tensor parallel 2),
    node 1 runs replica 1 (ranks 4-5). The trainers feed replica 0, which relays every piece to replica 1 across the
    node boundary; after every sync both replicas' engines hold exactly what vLLM's own loader makes of the
    trainer's weights (verify_weight_sync) and sample on-policy, and every rank trains exactly its prompts."""
    from hfllamarl.runtime.data.prompts import batch_rows

    out = str(tmp_path / "replicas")
    procs = launch_nodes("torchrun", 2, 3, [str(SCRIPTS / "train_tiny.py"), tiny_model, out, "--steps", "3",
                                            "--max-staleness", "0", "--report-to", "none", "--num-generators", "4",
                                            "--generator-tp", "2", "--verify-weight-sync"])
    results = []
    try:
        for proc in procs:
            results.append(proc.communicate(timeout=900))
    finally:
        for proc in procs:
            proc.kill()
    for node, (proc, (stdout, stderr)) in enumerate(zip(procs, results)):
        assert proc.returncode == 0, f"node {node} exited {proc.returncode}\n{stdout[-3000:]}\n{stderr[-5000:]}"
    steps = step_logs(results[0][0])
    assert [h["step"] for h in steps] == [1, 2, 3]
    for h in steps:
        assert h["staleness/max"] == 0 and h["replicas/live"] == 2
        assert_on_policy(h)  # every token of both replicas
    for rank in (0, 1):  # 2 trainer ranks x 16 completions / 4 per prompt = 8 prompts per step, 4 each
        rows = trained_rows(out, rank)
        for step in (1, 2, 3):
            assert rows[step] == batch_rows(64, 8, step - 1, seed=0)[4 * rank:4 * rank + 4], (rank, step)

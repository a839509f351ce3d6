"""scripts/: every shell file parses (bash -n); launch.sh and the sbatch scripts, run in dry-run mode inside a
fake Slurm allocation (SLURM_* variables and a fake `scontrol` on PATH), print the commands a real job would
run; the model configs parse with megacoat's own flags and have the sizes their names promise."""
import glob
import os
import shlex
import subprocess

import pytest

from megacoat.arguments import build_parser, config_from_args

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SCRIPTS = os.path.join(ROOT, "scripts")
SHELL_FILES = sorted(glob.glob(os.path.join(SCRIPTS, "*.sh")) + glob.glob(os.path.join(SCRIPTS, "*.sbatch"))
                     + glob.glob(os.path.join(SCRIPTS, "configs", "*.sh")))
CONFIG_SIZES = {"125m": 125e6, "1.3b": 1.3e9, "7b": 6.7e9, "13b": 13e9}


@pytest.fixture
def slurm(tmp_path):
    """A fake 3-node allocation: `scontrol show hostnames` expands the node list like Slurm does."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    scontrol = bin_dir / "scontrol"
    scontrol.write_text('#!/usr/bin/env bash\n[[ "$1 $2" == "show hostnames" ]] || exit 1\n'
                        '[[ "$3" == "gpu[07-09]" ]] && printf "gpu07\\ngpu08\\ngpu09\\n"\n')
    scontrol.chmod(0o755)
    env = dict(os.environ, PATH=f"{bin_dir}{os.pathsep}{os.environ['PATH']}", SLURM_JOB_NODELIST="gpu[07-09]",
               SLURM_JOB_ID="4242", SLURM_GPUS_ON_NODE="8", SLURM_SUBMIT_DIR=ROOT, CKPT_DIR=str(tmp_path / "ck"),
               LOG_DIR=str(tmp_path / "logs"), DRY_RUN="1")
    return env


def _run(cmd, env):
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=60, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr
    return proc.stdout


def _command_line(out: str) -> list[str]:
    return shlex.split([line for line in out.splitlines() if not line.startswith("#")][-1])


@pytest.mark.parametrize("path", SHELL_FILES, ids=lambda p: os.path.relpath(p, SCRIPTS))
def test_bash_parses(path):
    subprocess.run(["bash", "-n", path], check=True)


def test_multi_node_deepspeed_hostfile_and_master(slurm, tmp_path):
    out = _run(["bash", os.path.join(SCRIPTS, "launch.sh"), "--config", "7b", "--launcher", "deepspeed", "--",
                "--coat-fp8"], slurm)
    assert "#   gpu07 slots=8\n#   gpu08 slots=8\n#   gpu09 slots=8" in out
    cmd = _command_line(out)
    assert cmd[:2] == ["deepspeed", "--hostfile"]
    assert cmd[cmd.index("--master_addr") + 1] == "gpu07"
    assert cmd[cmd.index("--master_port") + 1] == str(20000 + 4242 % 20000)
    assert cmd[cmd.index("--num-layers") + 1] == "32" and cmd[-1] == "--coat-fp8"
    assert cmd[cmd.index("--save") + 1] == cmd[cmd.index("--load") + 1] == str(tmp_path / "ck")
    assert not (tmp_path / "ck").exists() and not (tmp_path / "logs").exists()  # a dry run writes nothing


def test_sbatch_uses_srun_one_task_per_gpu(slurm):
    out = _run(["bash", os.path.join(SCRIPTS, "slurm_pretrain.sbatch"), "--", "--fp8-optimizer"],
               dict(slurm, CONFIG="1.3b"))
    cmd = _command_line(out)
    assert cmd[:5] == ["srun", "--nodes", "3", "--ntasks-per-node", "8"]
    assert "MASTER_ADDR=gpu07" in cmd and cmd[cmd.index("MASTER_ADDR=gpu07") + 2].endswith("srun_rank.sh")
    assert cmd[cmd.index("--hidden-size") + 1] == "2048" and cmd[-1] == "--fp8-optimizer"
    text = open(os.path.join(SCRIPTS, "slurm_pretrain.sbatch")).read()
    assert "#SBATCH --signal=USR1@" in text and "#SBATCH --requeue" in text


def test_single_node_without_slurm_and_torchrun(slurm):
    env = {k: v for k, v in slurm.items() if not k.startswith("SLURM_")}
    cmd = _command_line(_run(["bash", os.path.join(SCRIPTS, "launch.sh"), "--config", "125m",
                              "--gpus-per-node", "4"], env))
    assert cmd[:3] == ["deepspeed", "--num_gpus", "4"]
    out = _run(["bash", os.path.join(SCRIPTS, "slurm_pretrain_1node.sbatch")], dict(slurm, LAUNCHER="torchrun"))
    cmd = _command_line(out)
    assert cmd[:6] == ["srun", "--nodes", "3", "--ntasks-per-node", "1", "torchrun"]
    assert cmd[cmd.index("--rdzv-endpoint") + 1] == f"gpu07:{20000 + 4242}"


def test_srun_rank_maps_slurm_variables(tmp_path):
    env = dict(os.environ, SLURM_PROCID="11", SLURM_LOCALID="3", SLURM_NTASKS="16", SLURM_NTASKS_PER_NODE="8")
    out = _run(["bash", os.path.join(SCRIPTS, "srun_rank.sh"), "bash", "-c",
                'echo "$RANK $LOCAL_RANK $WORLD_SIZE $LOCAL_WORLD_SIZE"'], env)
    assert out.split() == ["11", "3", "16", "8"]


def test_bad_options_are_named(slurm):
    for args, message in ((["--config", "70b"], "no config '70b'"), (["--launcher", "mpirun"], "--launcher must be"),
                          (["--bogus"], "unknown option --bogus")):
        proc = subprocess.run(["bash", os.path.join(SCRIPTS, "launch.sh")] + args, env=slurm, capture_output=True,
                              text=True, timeout=60)
        assert proc.returncode == 2 and message in proc.stderr, (args, proc.stderr)


@pytest.mark.parametrize("name", sorted(CONFIG_SIZES))
def test_configs_are_valid_megacoat_flags_of_the_promised_size(name):
    out = subprocess.run(["bash", "-c", f'source {SCRIPTS}/configs/{name}.sh; printf "%s\\n" "${{MODEL_ARGS[@]}}" '
                                        '"${TRAIN_ARGS[@]}"'], capture_output=True, text=True, check=True).stdout
    cfg = config_from_args(build_parser().parse_args(out.split("\n")[:-1] + ["--save", "/tmp/x"]))
    assert abs(cfg.model.num_parameters() / CONFIG_SIZES[name] - 1) < 0.15, cfg.model.num_parameters()

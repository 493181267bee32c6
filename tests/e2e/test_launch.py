"""`temoe launch`: the docker run, the sbatch script and the JobSet that one job description renders.

Overrides with spaces, quotes, $(...), backticks and newlines must reach `temoe train` verbatim and
never run: the sbatch script and the `docker run` line are executed by bash against stand-in
`srun`, `scontrol` and `docker` that record the argv they receive; the docker SDK's own conversion
checks the container request; the JobSet is validated against its schema and Kubernetes' own.
"""

from __future__ import annotations

import json
import os
import pathlib
import shlex
import shutil
import signal
import subprocess
import sys
import time
import zipfile

import jsonschema
import kubernetes_validate
import pytest
import referencing
import yaml
from conftest import ROOT
from temoe import exits
from temoe.deploy import launch
from temoe.run import distributed

NASTY = ["run_name=a b", "x=$(touch PWNED)", "y=`touch PWNED`", "q='\"\\", "z=;|&<>*?~#{}!$HOME", "n=two\nlines"]
ENV = {"TEMOE_NASTY": "$(touch PWNED) `touch PWNED` 'q\" $HOME"}


def job(**kw) -> launch.Job:
  return launch.Job(**{"config": "configs/deepseek3-671b-h100x1024.yml", "overrides": NASTY, "env": ENV,
                       "image": "nvcr.io/acme/temoe:1", "mounts": ["/lustre/data:/data:ro", "/lustre/runs:/runs"],
                       "name": "ds3", "nodes": 2, "gpus_per_node": 8, "workdir": "/lustre/jobs", **kw})


STAND_IN = """#!{python}
import json, os, signal, sys, time
argv = sys.argv[1:]
with open({log!r}, 'a') as f:
  f.write(json.dumps({{'tool': {name!r}, 'argv': argv, 'env': os.environ.get('TEMOE_NASTY')}}) + '\\n')
container = {log!r} + '.container'  # the engine's record of the last container: its exit code
run = {name!r} == 'docker' and argv[:1] == ['run']
if {name!r} == 'docker' and argv[:1] == ['inspect']:
  print(open(container).read())
  sys.exit(0)
if {name!r} == 'docker' and argv[:1] == ['rm']:
  os.remove(container)
  sys.exit(0)
if run and '--cidfile' in argv and not os.environ.get('FAKE_NOT_CREATED'):  # written once the engine created it
  with open(argv[argv.index('--cidfile') + 1], 'w') as f:
    f.write('c0ffee')
def finish(code):
  if run:  # the container exits `code`; the client may say otherwise (FAKE_CLIENT_RC: podman 4.3's `run --rm`)
    with open(container, 'w') as f:
      f.write(str(code))
    code = int(os.environ.get('FAKE_CLIENT_RC', code))
  sys.exit(code)
waiting = os.environ.get('FAKE_UNTIL_TERM')
if {name!r} == 'scancel' and waiting:  # Slurm signals the job's tasks (a stand-in srun: SIGUSR1, below)
  os.kill(int(open(waiting).read()), signal.SIGUSR1)
elif ({name!r} == 'srun' or run) and waiting:
  def exit_with(code):  # the first signal decides; a second one (a group's and a trap's) changes nothing
    def handle(*_):
      for sig in (signal.SIGTERM, signal.SIGUSR1):
        signal.signal(sig, signal.SIG_IGN)
      finish(code)
    return handle
  if {name!r} == 'srun':  # as srun does: a SIGTERM to srun itself kills the tasks at once
    signal.signal(signal.SIGTERM, exit_with(137))
    signal.signal(signal.SIGUSR1, exit_with(75))  # the tasks got SIGTERM: they save and exit 75
  else:  # docker run passes a SIGTERM to the container, which saves and exits 75
    signal.signal(signal.SIGTERM, exit_with(75))
  with open(waiting, 'w') as f:
    f.write(str(os.getpid()))
  time.sleep(60)
  finish(1)
finish(int(os.environ.get('FAKE_RC', '0')))
"""


def default_stop_signals():
  for sig in (signal.SIGINT, signal.SIGTERM):
    signal.signal(sig, signal.SIG_DFL)


@pytest.fixture
def recorder(tmp_path):
  """A bin/ of stand-ins (srun, scontrol, scancel, docker) that log argv and TEMOE_NASTY and exit $FAKE_RC;
  with FAKE_UNTIL_TERM=<file>, a run that waits for its stop: srun exits 75 when `scancel --signal` reaches its
  tasks and 137 on a SIGTERM of its own (srun kills the tasks), docker exits 75 on SIGTERM."""
  bin_dir, log = tmp_path / "bin", tmp_path / "calls.jsonl"
  bin_dir.mkdir()
  for name in ("srun", "scontrol", "scancel", "docker"):
    tool = bin_dir / name
    tool.write_text(STAND_IN.format(python=sys.executable, log=str(log), name=name))
    tool.chmod(0o755)
  venv = tmp_path / "venv" / "bin"
  venv.mkdir(parents=True)
  (venv / "activate").write_text("")

  def run(script: str, signal_after_start: int | None = None, **env) -> tuple[int, list[dict]]:
    """Runs `script` with bash; with `signal_after_start`, sends that signal to bash once the stand-in waits."""
    path, started = tmp_path / "job.sh", tmp_path / "started"
    path.write_text(script)
    full = {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}", "SLURM_JOB_ID": "7", **env}
    if signal_after_start is not None:
      full["FAKE_UNTIL_TERM"] = str(started)
    # Slurm and a terminal start the script with SIGINT and SIGTERM at their defaults; a pytest started as a
    # background job has SIGINT ignored, which its children inherit, and bash cannot trap a signal ignored on entry
    with subprocess.Popen(["bash", str(path)], cwd=tmp_path, env=full, start_new_session=True,
                          preexec_fn=default_stop_signals) as proc:
      if signal_after_start is not None:
        deadline = time.monotonic() + 30
        while not (started.exists() and started.read_text()) and time.monotonic() < deadline:
          time.sleep(0.02)
        time.sleep(0.1)  # the script is in its wait
        os.killpg(proc.pid, signal_after_start)  # the script's process group, as a terminal or a kill -- -PGID
      rc = proc.wait(60)
    started.unlink(missing_ok=True)
    calls = [json.loads(l) for l in log.read_text().splitlines()] if log.exists() else []
    log.unlink(missing_ok=True)
    assert not list(tmp_path.rglob("PWNED")), "an override was executed by a shell"
    return rc, calls

  run.venv = str(tmp_path / "venv")
  return run


def sbatch_options(script: str) -> dict:
  return dict(l[len("#SBATCH --"):].partition("=")[::2] for l in script.splitlines() if l.startswith("#SBATCH --"))


def test_slurm_pyxis_runs_one_task_per_gpu_with_overrides_verbatim(recorder):
  script = launch.sbatch_script(job())
  options = sbatch_options(script)
  assert options["nodes"] == "2" and options["ntasks-per-node"] == "8" and options["gpus-per-node"] == "8"
  assert "requeue" in options and options["chdir"] == "/lustre/jobs"
  rc, calls = recorder(script)
  assert rc == 0 and [c["tool"] for c in calls] == ["srun"]
  argv = calls[0]["argv"]
  assert argv[:5] == ["--container-image=nvcr.io/acme/temoe:1", "--container-mounts=/lustre/data:/data:ro,/lustre/runs:/runs",
                      "python3", "-m", "temoe.deploy.entrypoint"]  # the image's entrypoint: env profile for the GPU
  assert argv[5:] == ["train", "configs/deepseek3-671b-h100x1024.yml", *NASTY, "hardware=gpu_multiprocess"]
  assert calls[0]["env"] == ENV["TEMOE_NASTY"]


def test_slurm_virtualenv_jobs(recorder):
  script = launch.sbatch_script(job(image=None, venv=recorder.venv, gpus_per_node=0, tasks_per_node=2, nodes=1))
  options = sbatch_options(script)
  assert options["ntasks-per-node"] == "2" and "gpus-per-node" not in options
  rc, calls = recorder(script)
  assert rc == 0 and calls[0]["argv"] == ["temoe", "train", "configs/deepseek3-671b-h100x1024.yml", *NASTY]
  rc, calls = recorder(launch.sbatch_script(job(image=None, venv=recorder.venv)))  # GPUs: the profile's entrypoint
  assert rc == 0 and calls[0]["argv"] == ["python", "-m", "temoe.deploy.entrypoint", "train",
                                          "configs/deepseek3-671b-h100x1024.yml", *NASTY, "hardware=gpu_multiprocess"]


def test_slurm_requeues_only_the_requeue_code_until_max_restarts(recorder):
  script = launch.sbatch_script(job(max_restarts=2, grace_seconds=120))
  assert sbatch_options(script)["signal"] == "TERM@120"  # SIGTERM to the tasks 120 s before the time limit
  rc, calls = recorder(script, FAKE_RC=str(exits.REQUEUE), SLURM_RESTART_COUNT="1")
  assert rc == exits.REQUEUE and [(c["tool"], c["argv"]) for c in calls][1:] == [("scontrol", ["requeue", "7"])]
  rc, calls = recorder(script, FAKE_RC=str(exits.REQUEUE), SLURM_RESTART_COUNT="2")
  assert rc == exits.REQUEUE and [c["tool"] for c in calls] == ["srun"]  # out of restarts: fails for good
  for code in (exits.NEEDS_PERSON, exits.FAILED, 3, 137):  # needs a person, unknown, killed: never requeued
    rc, calls = recorder(script, FAKE_RC=str(code), SLURM_RESTART_COUNT="0")
    assert rc == code and [c["tool"] for c in calls] == ["srun"]


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_slurm_script_passes_a_signal_to_the_tasks_and_requeues_the_saved_run(recorder, sig):
  """A signal to the batch script's process group must reach the tasks through Slurm (scancel --signal),
  not srun (which would kill them: the stand-in exits 137), and the script requeue the job instead of
  dying with 143 as bash does by default."""
  rc, calls = recorder(launch.sbatch_script(job(max_restarts=1)), signal_after_start=sig, SLURM_RESTART_COUNT="0")
  assert rc == exits.REQUEUE, calls
  assert [(c["tool"], c["argv"][:1]) for c in calls[1:]] == [("scancel", ["--signal=TERM"]), ("scontrol", ["requeue"])]


def test_slurm_submit_calls_sbatch(tmp_path, recorder, monkeypatch, capsys):
  sbatch = tmp_path / "bin" / "sbatch"
  sbatch.write_text(f"#!{sys.executable}\nimport sys\nprint('42;cluster')\nopen({str(tmp_path / 'sbatch.argv')!r}, 'w').write(repr(sys.argv[1:]))\n")
  sbatch.chmod(0o755)
  monkeypatch.setenv("PATH", f"{tmp_path / 'bin'}:{os.environ['PATH']}")
  assert launch.main(["slurm", "--submit", "--workdir", str(tmp_path / "jobs"), "--name", "ds3", "--image", "img",
                      "cfg.yml", *NASTY]) == 0
  assert capsys.readouterr().out.strip() == "42"
  script = tmp_path / "jobs" / "ds3.sbatch"
  assert (tmp_path / "sbatch.argv").read_text() == repr(["--parsable", str(script)])
  assert "'x=$(touch PWNED)'" in script.read_text()


def test_docker_request_through_the_docker_sdk():
  from docker.models.containers import _create_container_args  # pylint: disable=import-outside-toplevel

  kwargs = launch.docker_run_kwargs(job(nodes=1, grace_seconds=90))
  assert kwargs.pop("stop_timeout") == 90  # temoe's own: run_docker's `docker stop` wait (containers.run has none)
  create = _create_container_args({**kwargs, "version": "1.45"})  # what containers.run sends the engine
  host = create["host_config"]
  assert create["image"] == "nvcr.io/acme/temoe:1"
  assert create["command"] == ["train", "configs/deepseek3-671b-h100x1024.yml", *NASTY, "hardware=gpu"]
  assert host["IpcMode"] == "host"
  assert [(r["Count"], r["Capabilities"]) for r in host["DeviceRequests"]] == [(-1, [["gpu"]])]
  assert {u["Name"]: (u["Soft"], u["Hard"]) for u in host["Ulimits"]} == {"memlock": (-1, -1),
                                                                         "stack": (2**26, 2**26)}
  assert host["Binds"] == ["/lustre/data:/data:ro", "/lustre/runs:/runs:rw"]
  assert create["environment"] == ENV


def test_docker_dry_run_line_is_copy_paste_safe(recorder, capsys):
  assert launch.main(["docker", "--dry-run", "--image", "img", "--gpus-per-node", "8", "--mount", "/a b:/data",
                      "--env", f"TEMOE_NASTY={ENV['TEMOE_NASTY']}", "cfg.yml", *NASTY]) == 0
  line = capsys.readouterr().out.strip()
  rc, calls = recorder(line)  # pasted into bash
  assert rc == 0
  assert calls[0]["argv"] == ["run", "--rm", "--name", "temoe", "-v", "/a b:/data:rw", "-e", f"TEMOE_NASTY={ENV['TEMOE_NASTY']}",
                              "--gpus", "all", "--ipc", "host", "--ulimit", "memlock=-1:-1",
                              "--ulimit", "stack=67108864:67108864", "--stop-timeout", "300", "img", "train", "cfg.yml",
                              *NASTY, "hardware=gpu"]
  assert shlex.split(line) == ["docker", *calls[0]["argv"]]
  wrapper = ["bash", str(ROOT / "launch" / "docker-run.sh"), "--name", "temoe", "-v", "/a b:/data:rw",
             "-e", f"TEMOE_NASTY={ENV['TEMOE_NASTY']}", "img", "train", "cfg.yml", *NASTY, "hardware=gpu"]
  rc, by_hand = recorder(shlex.join(wrapper))  # launch/docker-run.sh, as a user runs it: the same docker run,
  started = by_hand[0]["argv"]  # kept until its exit code is read (not --rm), the id in a --cidfile
  cid = started.index("--cidfile")
  assert rc == 0 and started[:cid] + started[cid + 2:] == [a for a in calls[0]["argv"] if a != "--rm"]
  assert [c["argv"] for c in by_hand[1:]] == [["inspect", "--format", "{{.State.ExitCode}}", "c0ffee"], ["rm", "-f", "c0ffee"]]
  rc, _ = recorder(shlex.join([*wrapper[:2], "--gpus", "2", "img"]))
  assert rc == 2


def test_docker_run_sh_starts_a_requeued_run_again_up_to_its_bound(recorder):
  wrapper = "exec " + shlex.join(["bash", str(ROOT / "launch" / "docker-run.sh"), "img", "train", "cfg.yml"])
  once = ["run", "inspect", "rm"]  # a start, its container's exit code read from the engine, the container removed
  rc, calls = recorder(wrapper, FAKE_RC=str(exits.REQUEUE), TEMOE_MAX_RESTARTS="2")
  assert rc == exits.REQUEUE and [c["argv"][0] for c in calls] == once * 3  # the first run and 2 restarts
  for code in (0, exits.NEEDS_PERSON, exits.FAILED):
    rc, calls = recorder(wrapper, FAKE_RC=str(code))
    assert rc == code and [c["argv"][0] for c in calls] == once
  rc, calls = recorder(wrapper, signal_after_start=signal.SIGTERM)  # `docker stop`-like: saved, not started again
  assert rc == exits.REQUEUE and [c["argv"][0] for c in calls] == once


def test_docker_run_sh_goes_by_the_containers_exit_code_not_the_clients(recorder):
  """podman 4.3's Docker API answers `docker run --rm` with 0 whatever the container's code: the wrapper reads the
  code from the engine, so an exit 75 is still started again and reported; a container never created (the name
  taken, the image missing) leaves docker run's own code and nothing to remove, the other container untouched."""
  wrapper = "exec " + shlex.join(["bash", str(ROOT / "launch" / "docker-run.sh"), "img", "train", "cfg.yml"])
  rc, calls = recorder(wrapper, FAKE_RC=str(exits.REQUEUE), FAKE_CLIENT_RC="0", TEMOE_MAX_RESTARTS="1")
  assert rc == exits.REQUEUE and [c["argv"][0] for c in calls] == ["run", "inspect", "rm"] * 2
  rc, calls = recorder(wrapper, FAKE_RC="125", FAKE_NOT_CREATED="1")
  assert rc == 125 and [c["argv"][0] for c in calls] == ["run"]
  name = calls[0]["argv"][calls[0]["argv"].index("--name") + 1]
  assert name.startswith("temoe-"), name  # the default name: one a user can find with `docker ps -a`


def test_docker_run_sh_survives_its_signal_trap_when_docker_is_already_gone():
  """A group's SIGTERM reaches docker and the script together; docker may exit and be reaped before the
  trap's kill runs. Under the script's `set -e` that failed kill must not end it (it exited 1, not 75)."""
  script = (ROOT / "launch" / "docker-run.sh").read_text()
  trap = next(line for line in script.splitlines() if line.startswith("trap "))
  assert '"$state/pid"' in trap, trap  # docker's pid, as the script records it
  for pid in ("999999999", ""):  # no such process: kill fails; no pid yet (docker not started): nothing to kill
    body = (f"set -euo pipefail\nstate=$(mktemp -d)\necho -n {pid} > \"$state/pid\"\n{trap}\nkill -TERM $$\n"
            "echo after-the-trap $stopping\n")
    proc = subprocess.run(["bash", "-c", body], capture_output=True, text=True, timeout=30)
    assert proc.returncode == 0 and proc.stdout.strip() == "after-the-trap 1", proc


def test_launchers_render_from_the_top_level_launch_folder():
  assert launch.TEMPLATES.resolve() == ROOT / "launch"  # plugin/temoe/deploy/templates links to it
  assert {"sbatch.sh.j2", "jobset.yaml.j2", launch.DOCKER_RUN, "README.md"} <= {p.name for p in launch.TEMPLATES.iterdir()}
  assert launch.docker_flags() == ["--gpus", "all", "--ipc", "host", "--ulimit", "memlock=-1:-1",
                                   "--ulimit", "stack=67108864:67108864"]
  with pytest.raises(ValueError, match="not one temoe maps"):
    launch._docker_options(["--privileged", "true"], gpus=True)  # pylint: disable=protected-access


def test_a_pip_installed_temoe_renders_the_same_launch_files(tmp_path):
  """A wheel built from this checkout carries launch/ as package data; `python -m temoe launch`
  from that install writes exactly what the checkout renders."""
  src = tmp_path / "src"  # a copy: building in the checkout would leave build/ and egg-info there
  src.mkdir()
  for name in ("pyproject.toml", "README.md"):
    shutil.copy(ROOT / name, src / name)
  ignore = shutil.ignore_patterns("__pycache__", "*.egg-info")
  shutil.copytree(ROOT / "plugin", src / "plugin", symlinks=True, ignore=ignore)
  shutil.copytree(ROOT / "launch", src / "launch", ignore=ignore)
  pip = [sys.executable, "-m", "pip", "-q"]
  subprocess.run([*pip, "wheel", "--no-deps", "-w", str(tmp_path / "dist"), str(src)], check=True, timeout=300)
  wheel = next((tmp_path / "dist").glob("temoe-*.whl"))
  with zipfile.ZipFile(wheel) as whl:
    shipped = {pathlib.PurePosixPath(n).name: whl.read(n) for n in whl.namelist() if n.startswith("temoe/deploy/templates/")}
  assert shipped == {p.name: p.read_bytes() for p in (ROOT / "launch").iterdir()}
  site = tmp_path / "site"
  subprocess.run([*pip, "install", "--no-deps", "--target", str(site), str(wheel)], check=True, timeout=300)
  argv = ["launch", "slurm", "--image", "nvcr.io/acme/temoe:1", "--nodes", "2", "--workdir", "/lustre/jobs",
          "--mount", "/lustre/runs:/runs", "cfg.yml", *NASTY]
  run = subprocess.run([sys.executable, "-c", "import temoe, sys; print(temoe.__file__, file=sys.stderr)"],
                       env={**os.environ, "PYTHONPATH": str(site)}, capture_output=True, text=True, check=True)
  assert run.stderr.strip() == str(site / "temoe" / "__init__.py")
  run = subprocess.run([sys.executable, "-m", "temoe", *argv], env={**os.environ, "PYTHONPATH": str(site)},
                       capture_output=True, text=True, timeout=120, check=False)
  assert run.returncode == 0, run.stderr
  assert run.stdout == launch.sbatch_script(launch.parse(argv[1:])[1])
  assert subprocess.run([sys.executable, "-m", "temoe", "--help"], capture_output=True, text=True,
                        check=False).stdout.startswith("usage: temoe <command>")


def jobset_validator():
  schemas = pathlib.Path(kubernetes_validate.__file__).parent / "kubernetes-json-schema"
  strict = max(schemas.glob("v*-local-strict"), key=lambda p: [int(x) for x in p.name[1:].split("-")[0].split(".")])
  core = referencing.Resource.from_contents(json.loads((strict / "_definitions.json").read_text()))
  schema = json.loads((pathlib.Path(__file__).parents[1] / "schemas" / "jobset-v1alpha2.json").read_text())
  return jsonschema.Draft202012Validator(schema, registry=core @ referencing.Registry())


def test_jobset_manifest_is_valid_and_passes_overrides_verbatim():
  manifest = yaml.safe_load(launch.jobset_manifest(job()))
  validator = jobset_validator()
  validator.validate(manifest)
  jobs = manifest["spec"]["replicatedJobs"]
  spec = jobs[0]["template"]["spec"]
  assert len(jobs) == 1 and jobs[0]["replicas"] == 1
  assert spec["completionMode"] == "Indexed" and spec["parallelism"] == spec["completions"] == 2
  pod = spec["template"]["spec"]
  container = pod["containers"][0]
  assert container["image"] == "nvcr.io/acme/temoe:1" and "command" not in container  # the image's entrypoint
  unescape = lambda s: s.replace("$$", "$")  # Kubernetes turns $$ into $ and expands nothing else escaped
  assert [unescape(a) for a in container["args"]] == ["train", "configs/deepseek3-671b-h100x1024.yml", *NASTY,
                                                      "hardware=gpu"]
  assert "$(touch" not in " ".join(container["args"]).replace("$$(", "")
  assert pod["terminationGracePeriodSeconds"] == 300  # SIGTERM to the kill: the run checkpoints its step
  rules = spec["podFailurePolicy"]["rules"]
  assert rules[0] == {"action": "Count", "onPodConditions": [{"type": "DisruptionTarget"}]}  # evicted: restart
  assert rules[1] == {"action": "FailJob", "onExitCodes": {"containerName": "temoe", "operator": "NotIn",
                                                           "values": [exits.REQUEUE]}}
  assert manifest["spec"]["failurePolicy"] == {  # exit 75 (BackoffLimitExceeded): restart; others fail for good
      "maxRestarts": 3, "rules": [{"name": "needsAPerson", "action": "FailJobSet",
                                   "onJobFailureReasons": ["PodFailurePolicy"]}]}
  env = {e["name"]: e.get("value", e.get("valueFrom")) for e in container["env"]}
  assert env["JAX_COORDINATOR_IP"] == "ds3-workers-0-0.ds3" and env["NNODES"] == "2"
  assert env["NODE_RANK"] == {"fieldRef": {"fieldPath": "metadata.annotations['batch.kubernetes.io/job-completion-index']"}}
  assert unescape(env["TEMOE_NASTY"]) == ENV["TEMOE_NASTY"]
  assert manifest["spec"]["network"] == {"enableDNSHostnames": True, "subdomain": "ds3"}
  assert container["resources"]["limits"]["nvidia.com/gpu"] == 8
  volumes = {v["name"]: v for v in pod["volumes"]}
  mounts = {m["mountPath"]: m["name"] for m in container["volumeMounts"]}
  assert volumes[mounts["/dev/shm"]]["emptyDir"] == {"medium": "Memory"}
  assert volumes[mounts["/data"]]["hostPath"] == {"path": "/lustre/data"}


def test_the_jobset_schema_rejects_what_kubernetes_would():
  validator = jobset_validator()
  manifest = yaml.safe_load(launch.jobset_manifest(job()))
  pod = manifest["spec"]["replicatedJobs"][0]["template"]["spec"]["template"]["spec"]
  pod["containers"][0]["argz"] = pod["containers"][0].pop("args")  # a typo Kubernetes' strict schema knows
  with pytest.raises(jsonschema.ValidationError):
    validator.validate(manifest)
  manifest = yaml.safe_load(launch.jobset_manifest(job()))
  manifest["spec"]["replicatedJob"] = manifest["spec"].pop("replicatedJobs")
  with pytest.raises(jsonschema.ValidationError):
    validator.validate(manifest)


BAD_JOBS = [  # argv -> the one line `temoe launch` prints (exit 2), before anything is rendered
    (["docker", "--dry-run", "--image", "i", "--nodes", "2", "c.yml"],
     "`temoe launch docker` runs on one host; use slurm or k8s for --nodes > 1"),
    (["docker", "--dry-run", "c.yml"], "`temoe launch docker` needs --image"),
    (["k8s", "--image", "i", "--name", "Bad_Name", "c.yml"],
     "--name 'Bad_Name': a JobSet name is lowercase letters, digits and '-' (at most 40)"),
    (["k8s", "--image", "i", "--mount", "/only-one-side", "c.yml"], "--mount '/only-one-side' is not HOST:CONTAINER[:ro|rw]"),
    (["slurm", "--env", "A;B=1", "c.yml"], "environment variable name 'A;B' is not a valid name"),
    (["slurm", "--workdir", "/a b", "c.yml"], "#SBATCH values cannot hold whitespace: '/a b'"),
    *[([launcher, "--image", "i", "--nodes", n, "c.yml"], f"--nodes {n}: must be at least 1")
      for launcher in ("slurm", "k8s") for n in ("0", "-1")],
    (["docker", "--dry-run", "--image", "i", "--nodes", "0", "c.yml"], "--nodes 0: must be at least 1"),
    *[([launcher, "--image", "i", "--gpus-per-node", "-1", "c.yml"], "--gpus-per-node -1: must be at least 0 (0: a CPU job)")
      for launcher in ("slurm", "k8s")],
    (["docker", "--dry-run", "--image", "i", "--gpus-per-node", "-8", "c.yml"],
     "--gpus-per-node -8: must be at least 0 (0: a CPU job)"),
    (["slurm", "--tasks-per-node", "0", "c.yml"], "--tasks-per-node 0: must be at least 1"),
    *[([launcher, "--image", "i", "--max-restarts", "-1", "c.yml"],
       "--max-restarts -1: must be at least 0 (0: never requeue or restart)") for launcher in ("slurm", "k8s")],
    *[([launcher, "--image", "i", "--mount", spec, "c.yml"], f"--mount {spec!r}: {side} {path!r} must be an absolute path")
      for launcher in ("docker", "slurm", "k8s")
      for spec, side, path in (("data:/data", "HOST", "data"), ("/data:data", "CONTAINER", "data"),
                               ("./runs:/runs:ro", "HOST", "./runs"))],
    (["slurm", "--image", "i", "--mount", "/a,b:/data", "c.yml"], "--mount '/a,b:/data': a pyxis mount cannot hold ','"),
    (["docker", "--dry-run", "--image", "", "c.yml"],
     "--image is empty: give an image name, or leave --image out (Slurm: a virtualenv)"),
    (["slurm", "", "c.yml"], "the config path is empty: give the MaxText YAML the job runs"),
    (["docker", "--dry-run", "--image", "i", "--name", "a b", "c.yml"],
     "--name 'a b': letters, digits, '_', '.' and '-', starting with a letter or digit"),
    (["slurm", "--image", "i", "--venv", "/v", "c.yml"],
     "--venv is for `temoe launch slurm` without --image; with an image the job runs in it"),
    *[([launcher, "--image", "i", "--env", f"{key}=3", "c.yml"],
       f"--env {key}: `temoe launch {launcher}` sets {key} itself (the job's process layout); it cannot be overridden")
      for launcher, key in (("k8s", "NODE_RANK"), ("k8s", "JAX_COORDINATOR_IP"), ("k8s", "NNODES"),
                            ("slurm", "SLURM_PROCID"), ("slurm", "JAX_COORDINATOR_ADDRESS"))],
    *[([launcher, "--image", "i", "--grace-seconds", "0", "c.yml"], "--grace-seconds 0: must be between 1 and 86400 "
       "(the time a run gets to save its step between SIGTERM and the kill)") for launcher in ("slurm", "k8s")],
    (["slurm", "--submit", "--workdir", "/proc/no-such-dir", "c.yml"],
     "--workdir /proc/no-such-dir: cannot write the job script there (No such file or directory); pass a directory "
     "this user can write (it also holds the job's log)"),
]


@pytest.mark.parametrize("argv,line", BAD_JOBS, ids=[" ".join(a) for a, _ in BAD_JOBS])
def test_bad_job_descriptions_get_one_clear_line(argv, line, capsys):
  assert launch.main(argv) == 2
  out, err = capsys.readouterr()
  assert (out, err) == ("", f"temoe launch: {line}\n")


@pytest.mark.parametrize("argv,line", [
    (["slurm", "--nodes", "two", "c.yml"], "argument --nodes: invalid int value: 'two'"),
    (["swarm", "c.yml"], "argument launcher: invalid choice: 'swarm' (choose from 'docker', 'slurm', 'k8s')"),
])
def test_unparseable_arguments_get_one_line_too(argv, line, capsys):
  with pytest.raises(SystemExit) as exit_:
    launch.main(argv)
  assert exit_.value.code == 2
  assert capsys.readouterr().err == f"temoe launch: {line} (see `temoe launch --help`)\n"


def test_distributed_joins_only_multi_task_slurm_steps():
  step = {"SLURM_JOB_ID": "1", "SLURM_STEP_NODELIST": "n1", "SLURM_NTASKS": "2", "SLURM_PROCID": "0", "SLURM_LOCALID": "0"}
  assert distributed.slurm_tasks(step) == 2
  assert distributed.slurm_tasks({k: v for k, v in step.items() if k != "SLURM_STEP_NODELIST"}) == 0  # sbatch, no srun
  assert not distributed.maybe_initialize({**step, "SLURM_NTASKS": "1"})

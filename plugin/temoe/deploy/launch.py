"""`temoe launch {docker,slurm,k8s}`: one job description rendered as a `docker run`, an sbatch
script, or a Kubernetes JobSet.

Every launcher runs `temoe train <config> [override ...]`, through the image's entrypoint
(`temoe.deploy.entrypoint`: the env profile for the node's GPU) for GPU jobs, with the overrides as separate argv
entries that no shell ever parses: the docker SDK and the JobSet pass argv lists, and the sbatch
script holds them shell-quoted (shlex) in a bash array that srun receives as argv. Process layout
and the MaxText mode that forms the jax.distributed group from it:

  docker  one process, all GPUs of one host           hardware=gpu
  slurm   one task per GPU (per `--tasks-per-node`    hardware=gpu_multiprocess: jax.distributed
          on CPUs), pyxis image or a virtualenv        .initialize() reads Slurm's environment
  k8s     one pod per node, all its GPUs, JobSet      hardware=gpu: MaxText reads JAX_COORDINATOR_IP,
          indexed pods                                 NNODES, NODE_RANK (the pod's completion index)

All three act on `temoe train`'s exit codes (`temoe.exits`) alike: only `REQUEUE` (75: preempted
after a synchronous checkpoint, a transient fault) runs the job again, at most --max-restarts
times; anything else ends it. Each gives the run --grace-seconds between SIGTERM and the kill to
save its step: sbatch's --signal and its forwarding trap, `docker run --stop-timeout`, the pod's
terminationGracePeriodSeconds.
"""

from __future__ import annotations

import argparse
import dataclasses
import fnmatch
import json
import os
import pathlib
import re
import shlex
import subprocess
import sys

from temoe import exits, oneline

TEMPLATES = pathlib.Path(__file__).parent / "templates"
"""The checkout's top-level launch/ (templates/ is a link to it; a wheel holds copies as package data):
sbatch.sh.j2, jobset.yaml.j2 and docker-run.sh, the files users read and copy."""

HARDWARE = {"docker": "gpu", "slurm": "gpu_multiprocess", "k8s": "gpu"}
"""MaxText's hardware mode for each launcher's process layout (GPU jobs; an explicit hardware= wins)."""

COORDINATOR_PORT = 3389

LAUNCHER_OWNED = {
    "docker": (),
    "slurm": ("SLURM_*", "JAX_COORDINATOR_*", "JAX_PROCESS_*", "JAX_NUM_PROCESSES", "NNODES", "NODE_RANK"),
    "k8s": ("JAX_COORDINATOR_IP", "JAX_COORDINATOR_PORT", "JAX_COORDINATOR_ADDRESS", "JAX_PROCESS_*",
            "JAX_NUM_PROCESSES", "NNODES", "NODE_RANK"),
}
"""Variables each launcher sets to lay out the job's processes (Slurm's own, JAX's, the JobSet's): an
--env of one would join processes to the wrong group, so it is refused."""


@dataclasses.dataclass
class Job:
  """What to run and where; every launcher renders the same description."""

  config: str
  overrides: list[str] = dataclasses.field(default_factory=list)
  name: str = "temoe"
  nodes: int = 1
  gpus_per_node: int = 8
  tasks_per_node: int | None = None  # Slurm: one per GPU unless given (CPU jobs: --gpus-per-node 0)
  image: str | None = None  # docker/k8s: required; Slurm: pyxis image, or None for a virtualenv
  venv: str | None = None  # Slurm without an image: the virtualenv to activate (default: this one)
  workdir: str = dataclasses.field(default_factory=os.getcwd)
  mounts: list[str] = dataclasses.field(default_factory=list)  # HOST:CONTAINER[:ro]
  env: dict[str, str] = dataclasses.field(default_factory=dict)
  sbatch_options: list[str] = dataclasses.field(default_factory=list)  # e.g. --partition=batch
  max_restarts: int = 3  # requeues (Slurm), restarts (JobSet, docker) after an exit 75
  grace_seconds: int = 300  # from SIGTERM to the kill: the run saves its step in between

  @property
  def tasks(self) -> int:
    return self.tasks_per_node or self.gpus_per_node or 1


def check(job: Job, launcher: str) -> None:
  """Refuses, with one line, a job no launcher should render: each value is checked before any
  template sees it (the templates would otherwise write `--nodes=0` or a named volume)."""
  if job.nodes < 1:
    raise ValueError(f"--nodes {job.nodes}: must be at least 1")
  if job.gpus_per_node < 0:
    raise ValueError(f"--gpus-per-node {job.gpus_per_node}: must be at least 0 (0: a CPU job)")
  if job.tasks_per_node is not None and job.tasks_per_node < 1:
    raise ValueError(f"--tasks-per-node {job.tasks_per_node}: must be at least 1")
  if job.max_restarts < 0:
    raise ValueError(f"--max-restarts {job.max_restarts}: must be at least 0 (0: never requeue or restart)")
  if not 1 <= job.grace_seconds <= 24 * 3600:
    raise ValueError(f"--grace-seconds {job.grace_seconds}: must be between 1 and 86400 (the time a run gets to "
                     "save its step between SIGTERM and the kill)")
  if not job.config.strip():
    raise ValueError("the config path is empty: give the MaxText YAML the job runs")
  if job.image is not None and not job.image.strip():
    raise ValueError("--image is empty: give an image name, or leave --image out (Slurm: a virtualenv)")
  if not job.name or not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9_.-]*", job.name):
    raise ValueError(f"--name {job.name!r}: letters, digits, '_', '.' and '-', starting with a letter or digit")
  for spec in job.mounts:
    _mount(spec)
  if job.venv and (launcher != "slurm" or job.image):
    raise ValueError("--venv is for `temoe launch slurm` without --image; with an image the job runs in it")


def environment(job: Job, launcher: str) -> dict[str, str]:
  """The job's own variables (--env). The env profile is not merged here: every GPU launch runs
  `temoe.deploy.entrypoint` (the image's ENTRYPOINT; `python -m temoe.deploy.entrypoint` under srun), which adds
  the profile for the GPU it finds on the node, under these and anything else the user set."""
  bad = [key for key in job.env if not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", key)]
  if bad:
    raise ValueError(f"environment variable name {bad[0]!r} is not a valid name")
  owned = [key for key in job.env if any(fnmatch.fnmatchcase(key, pattern) for pattern in LAUNCHER_OWNED[launcher])]
  if owned:
    raise ValueError(f"--env {owned[0]}: `temoe launch {launcher}` sets {owned[0]} itself (the job's process layout); "
                     "it cannot be overridden")
  return dict(job.env)


def train_argv(job: Job, launcher: str) -> list[str]:
  """`temoe` argv: train, the config, the overrides verbatim, and the launcher's hardware mode."""
  extra = []
  if job.gpus_per_node and not any(o.startswith("hardware=") for o in job.overrides):
    extra.append(f"hardware={HARDWARE[launcher]}")
  return ["train", job.config, *job.overrides, *extra]


def _mount(spec: str) -> tuple[str, str, str]:
  parts = spec.split(":")
  if len(parts) not in (2, 3) or not all(parts[:2]) or (len(parts) == 3 and parts[2] not in ("ro", "rw")):
    raise ValueError(f"--mount {spec!r} is not HOST:CONTAINER[:ro|rw]")
  for side, path in zip(("HOST", "CONTAINER"), parts[:2]):
    if not path.startswith("/"):  # docker would make a named volume of a relative HOST
      raise ValueError(f"--mount {spec!r}: {side} {path!r} must be an absolute path")
  return parts[0], parts[1], parts[2] if len(parts) == 3 else "rw"


DOCKER_RUN = "docker-run.sh"
"""launch/'s `docker run` wrapper; its TEMOE_DOCKER_FLAGS line is what every temoe container gets."""


def docker_flags() -> list[str]:
  """The TEMOE_DOCKER_FLAGS array of launch/docker-run.sh, as argv words."""
  text = (TEMPLATES / DOCKER_RUN).read_text(encoding="utf-8")
  found = re.search(r"^TEMOE_DOCKER_FLAGS=\((.*)\)$", text, re.MULTILINE)
  if not found:
    raise ValueError(f"{TEMPLATES / DOCKER_RUN} has no TEMOE_DOCKER_FLAGS=(...) line")
  return shlex.split(found.group(1))


def _docker_options(flags: list[str], gpus: bool) -> dict:
  """docker SDK keyword arguments for the `docker run` flags temoe uses (--gpus, --ipc, --ulimit)."""
  import docker  # pylint: disable=import-outside-toplevel

  out = {"device_requests": [], "ipc_mode": None, "ulimits": []}
  pairs = list(zip(flags[::2], flags[1::2]))
  if len(flags) % 2:
    raise ValueError(f"TEMOE_DOCKER_FLAGS: {flags[-1]!r} has no value")
  for flag, value in pairs:
    if flag == "--gpus" and value == "all":
      out["device_requests"] = [docker.types.DeviceRequest(count=-1, capabilities=[["gpu"]])] if gpus else []
    elif flag == "--ipc":
      out["ipc_mode"] = value
    elif flag == "--ulimit" and re.fullmatch(r"\w+=-?\d+:-?\d+", value):
      name, limits = value.split("=")
      soft, hard = map(int, limits.split(":"))
      out["ulimits"].append(docker.types.Ulimit(name=name, soft=soft, hard=hard))
    else:
      raise ValueError(f"TEMOE_DOCKER_FLAGS: `{flag} {value}` is not one temoe maps (--gpus all, --ipc, --ulimit N=S:H)")
  return out


def _need_image(job: Job, launcher: str) -> str:
  if not job.image:
    raise ValueError(f"`temoe launch {launcher}` needs --image")
  return job.image


def docker_run_kwargs(job: Job) -> dict:
  """Keyword arguments of docker SDK's `containers.run`: all GPUs, host IPC, memlock/stack ulimits."""
  check(job, "docker")
  if job.nodes != 1:
    raise ValueError("`temoe launch docker` runs on one host; use slurm or k8s for --nodes > 1")
  return {
      "image": _need_image(job, "docker"),
      "command": train_argv(job, "docker"),
      "name": job.name,
      **_docker_options(docker_flags(), bool(job.gpus_per_node)),
      "volumes": {host: {"bind": path, "mode": mode} for host, path, mode in map(_mount, job.mounts)},
      "environment": environment(job, "docker"),
      "stop_timeout": job.grace_seconds,  # temoe's: `docker stop`'s wait, which containers.run cannot set
  }


def docker_run_line(kwargs: dict) -> str:
  """The `docker run` command line equivalent to `kwargs`, quoted for any POSIX shell: what
  launch/docker-run.sh runs for the same --name, -v and -e, less its restarts (it starts the container without
  --rm and removes it once the engine gave its exit code)."""
  argv = ["docker", "run", "--rm", "--name", kwargs["name"]]
  for host, bind in kwargs["volumes"].items():
    argv += ["-v", f"{host}:{bind['bind']}:{bind['mode']}"]
  for key, value in kwargs["environment"].items():
    argv += ["-e", f"{key}={value}"]
  argv += ["--gpus", "all"] if kwargs["device_requests"] else []
  argv += ["--ipc", kwargs["ipc_mode"]] if kwargs["ipc_mode"] else []
  for ulimit in kwargs["ulimits"]:
    argv += ["--ulimit", f"{ulimit.name}={ulimit.soft}:{ulimit.hard}"]
  argv += ["--stop-timeout", str(kwargs["stop_timeout"])]
  return shlex.join([*argv, kwargs["image"], *kwargs["command"]])


def run_docker(job: Job) -> int:
  """Runs the container through the Docker engine, streams its output, and starts it again after an exit
  75 (at most --max-restarts times), as launch/docker-run.sh does; returns the last exit code.

  SIGTERM/SIGINT to this process stop the container as `docker stop` does (SIGTERM, then SIGKILL
  after --grace-seconds) and start no new one."""
  import signal  # pylint: disable=import-outside-toplevel

  import docker  # pylint: disable=import-outside-toplevel

  kwargs = docker_run_kwargs(job)  # a bad job is refused before the engine is asked anything
  grace = kwargs.pop("stop_timeout")
  running, stopping = [], []

  def stop(signum, frame):
    del signum, frame
    stopping.append(True)
    for container in running:
      container.stop(timeout=grace)

  previous = {sig: signal.signal(sig, stop) for sig in (signal.SIGTERM, signal.SIGINT)}
  try:
    for attempt in range(job.max_restarts + 1):
      try:
        container = docker.from_env().containers.run(detach=True, **kwargs)
      except docker.errors.DockerException as exc:
        raise ValueError(f"the Docker engine refused or cannot be reached ({exc}); `--dry-run` prints the "
                         "`docker run` line instead") from exc
      running.append(container)
      try:
        for chunk in container.logs(stream=True, follow=True):
          sys.stdout.buffer.write(chunk)
          sys.stdout.flush()
        code = int(container.wait()["StatusCode"])
      finally:
        running.remove(container)
        container.remove(force=True)
      if code != exits.REQUEUE or stopping or attempt == job.max_restarts:
        return code
      print(f"temoe launch: exit {code} (requeue): starting the container again (restart {attempt + 1} of "
            f"{job.max_restarts})", file=sys.stderr, flush=True)
    return code
  finally:
    for sig, handler in previous.items():
      signal.signal(sig, handler)


def _render(template: str, **values) -> str:
  import jinja2  # pylint: disable=import-outside-toplevel

  env = jinja2.Environment(
      loader=jinja2.FileSystemLoader(TEMPLATES), undefined=jinja2.StrictUndefined, keep_trailing_newline=True
  )
  env.filters["sh"] = lambda value: shlex.quote(str(value))
  env.filters["json"] = lambda value: json.dumps(value, ensure_ascii=False)  # a YAML double-quoted scalar
  env.filters["kube"] = lambda value: value.replace("$", "$$")  # Kubernetes expands $(VAR) in args and env
  return env.get_template(template).render(**values)


def sbatch_script(job: Job) -> str:
  """The sbatch script: one task per GPU, pyxis or a virtualenv, requeue on failure (resumes)."""
  check(job, "slurm")
  for value in (job.name, job.workdir, *job.sbatch_options):
    if any(c.isspace() for c in value):
      raise ValueError(f"#SBATCH values cannot hold whitespace: {value!r}")
  commas = [spec for spec in job.mounts if "," in spec]
  if commas:  # pyxis' --container-mounts is a comma-separated list
    raise ValueError(f"--mount {commas[0]!r}: a pyxis mount cannot hold ','")
  mounts = ",".join(":".join(m for m in _mount(spec) if m != "rw") for spec in job.mounts)
  return _render(
      "sbatch.sh.j2", job=job, tasks=job.tasks, argv=train_argv(job, "slurm"), env=environment(job, "slurm"),
      mounts=mounts, venv=job.venv or sys.prefix, requeue=exits.REQUEUE, needs_person=exits.NEEDS_PERSON,
  )


def submit(script: str, job: Job) -> str:
  """Writes the script into the job directory (beside its log) and submits it; returns the job id."""
  path = pathlib.Path(job.workdir, f"{job.name}.sbatch")
  try:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(script, encoding="utf-8")
  except OSError as exc:
    raise ValueError(f"--workdir {job.workdir}: cannot write the job script there ({exc.strerror or exc}); pass a "
                     "directory this user can write (it also holds the job's log)") from exc
  try:
    done = subprocess.run(["sbatch", "--parsable", str(path)], capture_output=True, text=True, check=True)
  except FileNotFoundError as exc:
    raise ValueError("sbatch is not on PATH: submit from a Slurm login node, or leave out --submit to print the "
                     "script") from exc
  return done.stdout.strip().split(";")[0]


def jobset_manifest(job: Job) -> str:
  """The JobSet: indexed pods, one per node, coordinator pod 0, GPUs, /dev/shm, image, env."""
  check(job, "k8s")
  image = _need_image(job, "k8s")
  if not re.fullmatch(r"[a-z0-9]([-a-z0-9]{0,38}[a-z0-9])?", job.name):
    raise ValueError(f"--name {job.name!r}: a JobSet name is lowercase letters, digits and '-' (at most 40)")
  volumes = [{"name": f"mount-{i}", "host": host, "path": path, "read_only": mode == "ro"}
             for i, (host, path, mode) in enumerate(map(_mount, job.mounts))]
  return _render(
      "jobset.yaml.j2", job=job, image=image, argv=train_argv(job, "k8s"), env=environment(job, "k8s"),
      volumes=volumes, coordinator=f"{job.name}-workers-0-0.{job.name}", port=COORDINATOR_PORT,
      requeue=exits.REQUEUE,
  )


def parse(argv: list[str]) -> tuple[str, Job, argparse.Namespace]:
  parser = oneline.ArgumentParser(prog="temoe launch", description=__doc__.splitlines()[0])
  parser.add_argument("launcher", choices=("docker", "slurm", "k8s"))
  parser.add_argument("config", help="MaxText YAML, as the job sees it (a path in the image or workdir)")
  parser.add_argument("overrides", nargs="*", help="MaxText key=value overrides, passed verbatim")
  parser.add_argument("--name", default="temoe")
  parser.add_argument("--nodes", type=int, default=1)
  parser.add_argument("--gpus-per-node", type=int, default=8, help="0 for a CPU job")
  parser.add_argument("--tasks-per-node", type=int, help="Slurm: default one per GPU")
  parser.add_argument("--image", help="container image (Slurm: pyxis; without it, a virtualenv)")
  parser.add_argument("--venv", help="Slurm without --image: virtualenv to activate (default: this one)")
  parser.add_argument("--workdir", default=os.getcwd(), help="Slurm: job directory (logs, script)")
  parser.add_argument("--mount", action="append", default=[], metavar="HOST:CONTAINER[:ro]")
  parser.add_argument("--env", action="append", default=[], metavar="KEY=VALUE")
  parser.add_argument("--sbatch", action="append", default=[], metavar="OPTION", help="extra #SBATCH option")
  parser.add_argument("--max-restarts", type=int, default=3,
                      help=f"Slurm requeues / JobSet and docker restarts after an exit {exits.REQUEUE} (requeue)")
  parser.add_argument("--grace-seconds", type=int, default=300,
                      help="from SIGTERM to the kill (Slurm: before the time limit): the run checkpoints its step")
  parser.add_argument("--dry-run", action="store_true", help="docker: print the `docker run` line")
  parser.add_argument("--submit", action="store_true", help="slurm: submit with sbatch")
  args = parser.parse_args(argv)
  bad_env = [e for e in args.env if "=" not in e]
  if bad_env:
    parser.error(f"--env needs KEY=VALUE: {bad_env[0]!r}")
  config = args.config
  if args.launcher == "slurm" and not args.image and config.strip():  # runs here, maybe from another directory
    config = os.path.abspath(config)
  job = Job(
      config=config, overrides=args.overrides, name=args.name, nodes=args.nodes,
      gpus_per_node=args.gpus_per_node, tasks_per_node=args.tasks_per_node, image=args.image, venv=args.venv,
      workdir=os.path.abspath(args.workdir), mounts=args.mount, env=dict(e.split("=", 1) for e in args.env),
      sbatch_options=args.sbatch, max_restarts=args.max_restarts, grace_seconds=args.grace_seconds,
  )
  return args.launcher, job, args


def main(argv: list[str]) -> int:
  """`temoe launch docker|slurm|k8s [options] <config.yml> [key=value ...]`."""
  launcher, job, args = parse(argv)
  try:
    if launcher == "docker":
      if args.dry_run:
        print(docker_run_line(docker_run_kwargs(job)))
        return 0
      return run_docker(job)
    if launcher == "slurm":
      script = sbatch_script(job)
      if args.submit:
        print(submit(script, job))
      else:
        print(script, end="")
      return 0
    print(jobset_manifest(job), end="")
    return 0
  except (ValueError, subprocess.CalledProcessError) as exc:
    detail = exc.stderr.strip() if isinstance(exc, subprocess.CalledProcessError) else exc
    print(f"temoe launch: {detail}", file=sys.stderr)
    return 2

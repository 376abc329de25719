"""The private Ray instance: loopback only, token-guarded, free ports, no orphans, labelled trials.

The fast tests need no Ray instance: joining a cluster that does not answer, stop signals,
stopping a recorded family of processes, the storage check. The slow ones start one private
instance for the module (in this process) and a second one in a driver subprocess.
"""

from __future__ import annotations

import contextlib
import http.client
import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import psutil
import pytest

from icr.errors import UserError
from studies import connection, launcher, processes, records, storage
from studies.frameworks import tune as tune_adapter
from studies.trials import KEY, TrialSpec, spec_of, trial_label

ROOT = Path(__file__).resolve().parent.parent
ENV = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), str(ROOT / "tests")])}


# --- joining --------------------------------------------------------------------------------


@pytest.mark.timeout(60)
def test_joining_an_address_where_nothing_answers_fails_with_one_line(monkeypatch) -> None:
    with pytest.raises(UserError, match="nothing answers at 127.0.0.1:1 ") as error:
        connection.connect("127.0.0.1:1")
    assert "\n" not in str(error.value)
    monkeypatch.setenv("RAY_ADDRESS", "127.0.0.1:1")  # what `auto` reads first
    with pytest.raises(UserError, match="--address auto: .*nothing answers at 127.0.0.1:1 "):
        connection.connect("auto")
    with pytest.raises(UserError, match="expected auto or HOST:PORT"):
        connection.reachable_gcs("nonsense")


@pytest.mark.timeout(60)
def test_joining_an_address_that_is_not_a_ray_cluster_fails_with_one_line() -> None:
    with socket.socket() as server:  # accepts connections, never speaks gRPC
        server.bind(("127.0.0.1", 0))
        server.listen()
        port = server.getsockname()[1]
        with pytest.raises(UserError, match=f"127.0.0.1:{port} answers but not as a Ray cluster"):
            connection.reachable_gcs(f"127.0.0.1:{port}", timeout=1.0)


# --- stop signals ----------------------------------------------------------------------------

SIGNALLED = """
import signal, sys
from studies.signals import StopSignals
if sys.argv[1] == "tune":  # a handler like Ray Tune's: stop gracefully, no KeyboardInterrupt
    signal.signal(signal.SIGINT, lambda s, f: (print("graceful stop", flush=True), sys.exit(3)))
with StopSignals():
    try:
        print("ready", flush=True)
        while True:
            signal.pause()
    except KeyboardInterrupt:
        print("interrupted", flush=True)
        sys.exit(130)
"""


# A stop signal that lands in a weakref callback (where Python drops exceptions), then the check
# the entry point makes.
SIGNALLED_IN_A_CALLBACK = """
import gc, signal, sys, weakref
from studies.signals import StopSignals
class Thing:
    pass
with StopSignals() as stop:
    thing = Thing()
    ref = weakref.ref(thing, lambda r: signal.raise_signal(signal.SIGHUP))
    del thing
    gc.collect()
    print("after the callback", flush=True)
    try:
        stop.check()
    except KeyboardInterrupt:
        print("interrupted", flush=True)
        sys.exit(130)
"""


@pytest.mark.timeout(60)
def test_a_stop_signal_inside_a_weakref_callback_prints_no_traceback_and_still_stops() -> None:
    """CI's chaos run met a SIGHUP inside a WeakValueDictionary's callback: Python printed
    "Exception ignored in ..." and the handler's KeyboardInterrupt traceback; the driver's
    output must hold no traceback."""
    done = subprocess.run([sys.executable, "-c", SIGNALLED_IN_A_CALLBACK], cwd=ROOT, env=ENV,
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 130, done.stderr
    assert done.stdout.split() == ["after", "the", "callback", "interrupted"]
    assert "Traceback" not in done.stderr and "Exception ignored" not in done.stderr, done.stderr


@pytest.mark.timeout(60)
@pytest.mark.parametrize(("sig", "mode", "code", "said"), [
    (signal.SIGTERM, "plain", 130, "interrupted"),
    (signal.SIGHUP, "plain", 130, "interrupted"),
    (signal.SIGTERM, "tune", 3, "graceful stop"),
])
def test_sigterm_and_sighup_stop_the_driver_as_ctrl_c(sig: int, mode: str, code: int, said: str) -> None:
    child = subprocess.Popen([sys.executable, "-c", SIGNALLED, mode], cwd=ROOT, env=ENV,
                             stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    assert child.stdout.readline().strip() == "ready"
    child.send_signal(sig)
    out, _ = child.communicate(timeout=30)
    assert child.returncode == code and said in out


# --- stopping a recorded instance --------------------------------------------------------------

SLEEPER = """
import sys, time
held = open(sys.argv[1], sys.argv[2] if len(sys.argv) > 2 else "w") if len(sys.argv) > 1 else None
print("up", flush=True)
time.sleep(600)
"""


def _sleeper(env: dict[str, str], *args: str) -> subprocess.Popen:
    proc = subprocess.Popen([sys.executable, "-c", SLEEPER, *args], env=env,
                            stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "up"
    return proc


LAUNCHING_DRIVER = """
import os, subprocess, sys, time
child = subprocess.Popen([sys.executable, "-c", "import time; print('up', flush=True); time.sleep(600)"],
                         env={**os.environ, sys.argv[1]: sys.argv[2]}, stdout=subprocess.PIPE, text=True)
child.stdout.readline()
print(child.pid, flush=True)
time.sleep(600)
"""


def test_a_recorded_instance_stops_exactly_its_own_processes(tmp_path: Path) -> None:
    record = tmp_path / "ray-instance.json"
    marker = launcher.new_marker(records.owner_of(record))
    folder = launcher._new_temp_dir(marker)  # made for the instance
    # A driver whose launcher (its child) carries the marker.
    driver = subprocess.Popen([sys.executable, "-c", LAUNCHING_DRIVER, processes.MARKER, marker],
                              stdout=subprocess.PIPE, text=True)
    launched = int(driver.stdout.readline())
    launched_at = processes.describe([launched])[0]["create_time"]
    agent = _sleeper(dict(os.environ), str(folder / "agent.log"))  # blank env, a log file open
    stranger = _sleeper({**os.environ, processes.MARKER: "other"})
    try:
        live_driver = processes.describe([driver.pid])[0]
        processes.write_record(record, {"marker": marker, "temp_dir": str(folder),
                                        "launcher": {"pid": launched}, "driver": live_driver})
        with pytest.raises(UserError, match=f"running driver .PID {driver.pid}"):
            records.stop_recorded_instance(record)
        assert processes.alive(launched, launched_at) and agent.poll() is None

        # A record that names a running driver whose child is not the instance's proves nothing.
        stranger_driver = processes.describe([stranger.pid])[0]
        processes.write_record(record, {"marker": marker, "temp_dir": str(folder),
                                        "launcher": {"pid": launched}, "driver": stranger_driver})
        driver.kill()  # the driver dies; its launcher and the agent are left
        driver.wait()
        stopped = records.stop_recorded_instance(record)
        assert sorted(stopped) == sorted([launched, agent.pid])
        assert agent.wait(timeout=30) is not None and not processes.alive(launched, launched_at)
        assert stranger.poll() is None
        assert not record.exists() and not folder.exists()
        assert records.stop_recorded_instance(record) == []  # nothing recorded: nothing to do
    finally:
        for proc in (driver, agent, stranger):
            proc.kill()
            proc.wait()
        if processes.alive(launched, launched_at):
            os.kill(launched, signal.SIGKILL)
        launcher.remove_temp_dir(folder)


SPAWNING_DRIVER = """
import subprocess, sys, time
held = open(sys.argv[1], "w")  # a driver holds files open in the instance's folder (its logs)
child = subprocess.Popen([sys.executable, "-c", "import time; print('up', flush=True); time.sleep(600)"],
                         stdout=subprocess.PIPE, text=True)  # e.g. multiprocessing's resource tracker
child.stdout.readline()
print(child.pid, flush=True)
time.sleep(600)
"""


def test_the_launcher_s_sweep_spares_the_driver_and_the_processes_it_started(tmp_path: Path) -> None:
    """The launcher's sweep at exit (``sweep_family_at_exit``) spares the driver, which holds
    files open in the instance's folder: it spares what the driver started itself too (Python's
    resource tracker died so at every study's end, and a driver's next semaphore warned
    "resource_tracker: process died unexpectedly") and a process that only reads a log there,
    and stops the instance's own processes."""
    marker = launcher.new_marker()
    folder = launcher._new_temp_dir(marker)
    driver = subprocess.Popen([sys.executable, "-c", SPAWNING_DRIVER, str(folder / "driver.log")],
                              stdout=subprocess.PIPE, text=True)
    own_child = int(driver.stdout.readline())
    agent = _sleeper({**os.environ, processes.MARKER: marker})
    reader = _sleeper(dict(os.environ), str(folder / "driver.log"), "r")  # a user's `tail -f`
    try:
        spare = {driver.pid}
        assert [p.pid for p in processes.family(marker, folder, spare)] == [agent.pid]
        assert processes.stop_family(marker, folder, spare=spare) == [agent.pid]
        assert agent.wait(timeout=30) is not None
        assert driver.poll() is None and psutil.Process(own_child).status() != psutil.STATUS_ZOMBIE
        assert reader.poll() is None
        # Unspared (the driver is gone, say), the driver's folder file names it and its child.
        assert {p.pid for p in processes.family(marker, folder)} == {driver.pid, own_child}
    finally:
        for proc in (driver, agent, reader):
            proc.kill()
            proc.wait()
        with contextlib.suppress(psutil.Error):
            psutil.Process(own_child).kill()
        launcher.remove_temp_dir(folder)


# --- a `ray start` that gives up ----------------------------------------------------------------

# Stand-ins for `ray start --head --block`: one gives up as Ray does when its dashboard answers too
# late on a loaded machine; the other "runs" (writes the address file Ray writes, then blocks).
GIVES_UP = ("import sys; print('Starting Ray...'); "
            "print('ERROR: Failed to start the dashboard, return code 1'); "
            "print('Use `ray start --help` for more'); sys.exit(1)")
RUNS = ("import pathlib, signal, sys; "
        "pathlib.Path(sys.argv[1], 'ray_current_cluster').write_text('127.0.0.1:6399'); "
        "signal.pause()")
RUNS_AS_A_NODE = ("import signal; print('Ray runtime started.', flush=True); signal.pause()")


def fake_ray_start(monkeypatch, scripts: list[str]) -> list[Path]:
    """Replace the launcher's command by the scripts, one per start; returns the temp folders."""
    launch, folders = launcher._launch, []

    def launch_script(cmd: list[str], env: dict[str, str], temp_dir: Path) -> subprocess.Popen:
        folders.append(temp_dir)
        return launch([sys.executable, "-c", scripts[len(folders) - 1], str(temp_dir)], env, temp_dir)

    monkeypatch.setattr(launcher, "_launch", launch_script)
    return folders


@pytest.mark.timeout(60)
def test_a_head_whose_ray_start_gave_up_is_started_again(monkeypatch) -> None:
    folders = fake_ray_start(monkeypatch, [GIVES_UP, RUNS])
    instance = launcher.start_head(num_cpus=1, dashboard=False)
    try:
        assert instance.address == "127.0.0.1:6399" and instance.temp_dir == folders[1]
        assert not folders[0].exists()  # the failed attempt's folder is gone
    finally:
        launcher.stop_instance(instance)
    assert not processes.family(instance.marker, instance.temp_dir)


@pytest.mark.timeout(60)
def test_a_head_that_always_gives_up_fails_with_the_line_that_says_why(monkeypatch) -> None:
    folders = fake_ray_start(monkeypatch, [GIVES_UP] * launcher.START_ATTEMPTS)
    with pytest.raises(UserError) as error:
        launcher.start_head(num_cpus=1, dashboard=False)
    assert str(error.value) == (
        "the private Ray instance did not start (`ray start` exited with 1): ERROR: Failed to start "
        f"the dashboard, return code 1; see {folders[-1]}")
    assert not any(f.exists() for f in folders[:-1]) and (folders[-1] / "ray-start.log").is_file()
    launcher.remove_temp_dir(folders[-1])


@pytest.mark.timeout(60)
def test_a_joining_node_whose_ray_start_gave_up_is_started_again(monkeypatch) -> None:
    folders = fake_ray_start(monkeypatch, [GIVES_UP, GIVES_UP, RUNS_AS_A_NODE])
    instance = launcher.start_node("127.0.0.1:6399", num_cpus=1)
    try:
        assert instance.temp_dir == folders[2] and not folders[0].exists() and not folders[1].exists()
    finally:
        launcher.stop_instance(instance)
    assert not processes.family(instance.marker, instance.temp_dir)


# --- storage ----------------------------------------------------------------------------------

MOUNTS = "/dev/sda1 / ext4 rw 0 0\nnfs:/export /mnt/shared nfs4 rw 0 0\n"


def test_nodes_on_one_machine_share_its_disk() -> None:
    storage.check_storage("/home/me/workspace/ray", nodes=2, mounts=MOUNTS, hosts=1)
    with pytest.raises(UserError, match="local disk"):
        storage.check_storage("/home/me/workspace/ray", nodes=2, mounts=MOUNTS, hosts=2)
    with pytest.raises(UserError, match="local disk"):
        storage.check_storage("/home/me/workspace/ray", nodes=2, mounts=MOUNTS)


# --- a private instance ------------------------------------------------------------------------


def test_the_driver_sends_an_existing_token_without_ray_s_warning(tmp_path) -> None:
    """With a token and no ``RAY_AUTH_MODE``, the driver turns token authentication on for
    itself, and Ray's "Token authentication is enabled ... opt out" warning is not printed (the
    status line says how to sign in)."""
    token = tmp_path / "auth_token"
    token.write_text("0" * 64)
    env = {k: v for k, v in ENV.items() if k not in ("RAY_AUTH_MODE", "RAY_AUTH_TOKEN")}
    code = ("import logging, os; logging.basicConfig(); "
            "from studies.frameworks import ray as r; r.send_token_if_present(); "
            "print(os.environ.get('RAY_AUTH_MODE'))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                         env={**env, "RAY_AUTH_TOKEN_PATH": str(token)}, check=True)
    assert out.stdout.strip() == "token"
    assert "Token authentication" not in out.stderr, out.stderr


@pytest.fixture(scope="module")
def local(tmp_path_factory):
    record = tmp_path_factory.mktemp("run") / "ray-instance.json"
    own = _sleeper(dict(os.environ))  # a process the driver started itself, not Ray
    try:
        cluster = connection.connect(num_cpus=2, dashboard=True, record=record)
        yield cluster
        connection.disconnect(cluster)
        assert not processes.family(cluster.instance.marker, cluster.instance.temp_dir)
        assert not record.exists() and not cluster.instance.temp_dir.exists()
        assert own.poll() is None  # the instance's stop left it running
    finally:
        own.kill()
        own.wait()


def _token() -> str:
    path = os.environ.get("RAY_AUTH_TOKEN_PATH") or Path.home() / ".ray" / "auth_token"
    return Path(path).read_text().strip()


def _http_get(url: str, token: str | None = None) -> tuple[int | None, str]:
    """(status, body) of a GET; (None, "") when what answers does not speak HTTP/1."""
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    try:
        with urllib.request.urlopen(urllib.request.Request(url, headers=headers), timeout=5) as r:
            return r.status, r.read(1 << 20).decode(errors="replace")
    except urllib.error.HTTPError as exc:
        return exc.code, ""
    except (http.client.HTTPException, ConnectionResetError):  # gRPC: not an HTTP/1 reply
        return None, ""


def _grpc_code(port: int, method: str) -> str:
    import grpc

    with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
        try:
            channel.unary_unary(method)(b"", timeout=5)
        except grpc.RpcError as exc:
            return exc.code().name
    return "OK"


def _listening(cluster: connection.Cluster) -> dict[int, tuple[str, str]]:
    """port -> (address, process name) of every listening TCP socket of the instance and driver."""
    import psutil

    found = {}
    instance = cluster.instance
    for proc in processes.family(instance.marker, instance.temp_dir) + [psutil.Process()]:
        for conn in proc.net_connections(kind="inet"):
            if conn.status == psutil.CONN_LISTEN and conn.type == socket.SOCK_STREAM:
                found[conn.laddr.port] = (conn.laddr.ip, proc.name())
    return found


@pytest.mark.slow
def test_every_socket_is_on_loopback_and_needs_the_token(local) -> None:
    import ray

    @ray.remote
    def pid() -> int:
        return os.getpid()

    assert len(set(ray.get([pid.remote() for _ in range(4)]))) >= 1  # workers are listening too
    sockets = _listening(local)
    assert len(sockets) >= 10, sockets  # GCS, raylet x2, agents, dashboard, workers, driver
    assert {ip for ip, _ in sockets.values()} <= {"127.0.0.1", "::ffff:127.0.0.1"}, sockets

    node = next(n for n in ray.nodes() if n["Alive"])
    metrics = {node["MetricsExportPort"], local.instance.ports["dashboard_metrics"],
               local.instance.ports["autoscaler_metrics"]}
    token = _token()
    grpc_methods = {
        int(local.address.rsplit(":", 1)[1]): "/ray.rpc.NodeInfoGcsService/GetClusterId",
        node["NodeManagerPort"]: "/ray.rpc.NodeManagerService/GetNodeStats",
        node["ObjectManagerPort"]: "/ray.rpc.ObjectManagerService/Pull",
        node["MetricsAgentPort"]: "/ray.rpc.ReporterService/HealthCheck",
        local.instance.ports["ray_client_server"]: "/ray.rpc.RayletDriver/ClusterInfo",
    }
    for port, (_, name) in sockets.items():
        status, body = _http_get(f"http://127.0.0.1:{port}/api/version")
        if status is None:  # gRPC: refused without the token
            method = grpc_methods.get(port, "/ray.rpc.CoreWorkerService/NumPendingTasks")
            assert _grpc_code(port, method) == "UNAUTHENTICATED", (port, name, method)
        elif port in metrics:  # the Prometheus exporters: read-only, loopback (docs/running-studies.md)
            assert status == 200 and "# HELP" in body, (port, name)
        else:  # dashboard, agent, runtime-env agent
            assert status == 401, (port, name, status)
    assert _http_get(f"{local.dashboard_url}/api/version", token)[0] == 200
    assert metrics <= set(sockets)


@pytest.mark.slow
def test_trial_actors_show_their_trial_in_the_dashboard(local, tmp_path: Path) -> None:
    from ray import tune
    from ray.util.state import list_actors

    def trial(config: dict, scale: float) -> None:
        tune.report({"score": scale * spec_of(config).config.objective.eta})

    trainable = tune_adapter.labelled_trainable(
        tune.with_resources(tune.with_parameters(trial, scale=2.0), {"cpu": 1}), trial_label)
    specs = [TrialSpec.resolve("lagrangian", {"objective.name": "lagrangian"}, {"objective.eta": eta})
             for eta in (0.1, 0.25)]
    tuner = tune.Tuner(
        trainable,
        param_space={KEY: tune.grid_search(specs)},
        run_config=tune.RunConfig(name="labels", storage_path=str(tmp_path), verbose=0),
    )
    grid = tuner.fit()
    assert grid.num_errors == 0 and len(grid) == 2
    expected = {trial_label(r.metrics["trial_id"], r.config) for r in grid}
    assert expected == {f"trial {r.metrics['trial_id']} [lagrangian eta={eta}]"
                        for r, eta in zip(grid, (0.1, 0.25), strict=True)}
    actors = list_actors(address=local.dashboard_url, detail=True, limit=1000,
                         filters=[("class_name", "=", "trial")])
    assert expected <= {a.repr_name for a in actors}, [(a.class_name, a.repr_name) for a in actors]


@pytest.mark.slow
def test_joining_with_a_wrong_token_fails_with_one_line(local, monkeypatch) -> None:
    assert connection.reachable_gcs(local.address) == local.address
    monkeypatch.setenv("RAY_AUTH_TOKEN", "not-the-token")
    with pytest.raises(UserError, match="wants its token; copy the head's ~/.ray/auth_token"):
        connection.reachable_gcs(local.address)


SECOND_DRIVER = """
import json, sys
from pathlib import Path
from studies import connection
cluster = connection.connect(num_cpus=1, dashboard=True, record=Path(sys.argv[1]))
print(json.dumps({"dashboard_url": cluster.dashboard_url}), flush=True)
sys.stdin.read()  # until the test kills this driver
"""


def _logs_answer(dashboard_url: str, token: str) -> tuple:
    """The dashboard lists the node's log files and serves one (what its log pages show).

    A node's agent announces itself to the dashboard a few seconds after the node starts.
    """
    deadline = time.monotonic() + 60
    while True:
        listed = _http_get(f"{dashboard_url}/api/v0/logs?node_ip=127.0.0.1", token)
        served = _http_get(f"{dashboard_url}/api/v0/logs/file?node_ip=127.0.0.1"
                           "&filename=raylet.out&lines=5", token)
        if (listed[0] == 200 and "raylet.out" in listed[1] and served[0] == 200 and served[1]) \
                or time.monotonic() > deadline:
            return listed[0], served[0], "raylet.out" in listed[1], bool(served[1])
        time.sleep(0.5)


@pytest.mark.slow
@pytest.mark.timeout(600)  # a hang guard: two Ray instances start slowly on a starved machine
def test_two_instances_and_a_killed_driver_leaves_nothing(local, tmp_path: Path) -> None:
    import ray

    record = tmp_path / "run" / "ray-instance.json"
    driver = subprocess.Popen([sys.executable, "-c", SECOND_DRIVER, str(record)], cwd=ROOT, env=ENV,
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                              stderr=open(tmp_path / "driver.log", "w"), text=True)  # noqa: SIM115
    try:
        line = driver.stdout.readline()
        assert line, (tmp_path / "driver.log").read_text()[-2000:]
        other = json.loads(line)["dashboard_url"]
        assert other != local.dashboard_url
        token = _token()
        for url in (local.dashboard_url, other):  # both dashboards, their log pages included
            assert _http_get(f"{url}/api/version", token)[0] == 200
            assert _logs_answer(url, token) == (200, 200, True, True), url
        saved = json.loads(record.read_text())
        assert saved["processes"] and saved["session_dir"].startswith(saved["temp_dir"])
    finally:
        driver.kill()  # SIGKILL: no cleanup of its own
        driver.wait()
    # The worst case: the launcher dies too (alone, it stops the instance when the driver dies),
    # so Ray's agents are left running.
    with contextlib.suppress(ProcessLookupError):
        os.kill(saved["launcher"]["pid"], signal.SIGKILL)
    assert records.stop_recorded_instance(record)
    assert not processes.family(saved["marker"], Path(saved["temp_dir"]))
    assert not record.exists() and not Path(saved["temp_dir"]).exists()

    @ray.remote
    def alive() -> bool:
        return True

    assert ray.get(alive.remote())  # this module's instance was not touched


@pytest.mark.slow
@pytest.mark.timeout(600)  # a hang guard: a Ray instance starts slowly on a starved machine
def test_no_process_of_a_private_instance_outlives_a_killed_driver(tmp_path: Path) -> None:
    """SIGKILL of the driver in its report phase: a `multiprocessing` forkserver child of the
    study (the dashboard's, and its module processes) was still running 5 s later. The
    launcher gets SIGTERM when the driver dies; it must not exit before the whole family has."""
    import psutil

    record = tmp_path / "run" / "ray-instance.json"
    driver = subprocess.Popen([sys.executable, "-c", SECOND_DRIVER, str(record)], cwd=ROOT, env=ENV,
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                              stderr=open(tmp_path / "driver.log", "w"), text=True)  # noqa: SIM115
    try:
        assert driver.stdout.readline(), (tmp_path / "driver.log").read_text()[-2000:]
        saved = json.loads(record.read_text())
        family = processes.family(saved["marker"], Path(saved["temp_dir"]))
        assert any("forkserver" in " ".join(p.cmdline()) for p in family)  # the dashboard's
    finally:
        driver.kill()  # SIGKILL: no cleanup of its own
        driver.wait()
    launcher = psutil.Process(saved["launcher"]["pid"])
    deadline = time.monotonic() + 120
    with contextlib.suppress(psutil.NoSuchProcess):  # exited: a zombie until someone reaps it
        while launcher.status() != psutil.STATUS_ZOMBIE and time.monotonic() < deadline:
            time.sleep(0.05)  # waits for the launcher, not for time
    left = processes.family(saved["marker"], Path(saved["temp_dir"]))
    assert not left, [(p.pid, " ".join(p.cmdline())[:80]) for p in left]
    records.stop_recorded_instance(record)  # the record and the temp folder

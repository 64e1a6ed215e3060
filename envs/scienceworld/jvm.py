"""One ScienceWorld JVM: started with our JVM options, driven over py4j, ended for sure.

The package's ``ScienceWorldEnv.__init__`` launches its JVM with no options at all (the JVM then takes a
quarter of the machine's RAM as heap, ~750 MB RSS once warm) and a py4j callback server it never uses.
:class:`Simulator` launches the same jar the same way (``py4j.java_gateway.launch_gateway``, cwd the
package folder, ``die_on_exit`` so the JVM ends with this process) but with ``javaopts`` (heap cap, GC),
and talks to the simulator's ``PythonInterface`` directly. The JVM stays in this process group, so a
worker kill (``cope.envs.runtime.pool``) reaches it. Imports of py4j/scienceworld are lazy.
"""
from __future__ import annotations

import subprocess
import time
from typing import Any

INSTALL_HINT = "install the extra: pip install 'cope-trainer[scienceworld]'"
# SerialGC: one GC thread and a small footprint (the default of jvm_args, which a config may replace)
DEFAULT_JVM_ARGS = ("-XX:+UseSerialGC",)
# hashCode=2: constant identity hashes, which fixes the simulator's otherwise random order of objects (room
# descriptions, the bees of grow-fruit) from JVM to JVM: reproducible transcripts and replays. Every JVM gets these.
HASH_CODE = "-XX:hashCode=2"
REPRODUCIBLE_JVM_ARGS = ("-XX:+UnlockExperimentalVMOptions", HASH_CODE)


def backend() -> tuple[Any, Any, Any, str, str]:
    """py4j's launcher and the package's jar, imported lazily (ImportError names the extra)."""
    try:
        from py4j.java_gateway import GatewayParameters, JavaGateway, launch_gateway
        from scienceworld.constants import BASEPATH, JAR_PATH
    except ImportError as e:
        raise ImportError(f"ScienceWorldEnv needs the 'scienceworld' package; {INSTALL_HINT}") from e
    return launch_gateway, JavaGateway, GatewayParameters, JAR_PATH, BASEPATH


class Simulator:
    """One ScienceWorld JVM and its ``PythonInterface`` (what the package's wrapper drives)."""

    def __init__(self, javaopts: list[str]):
        launch_gateway, JavaGateway, GatewayParameters, jar, cwd = backend()
        t0 = time.perf_counter()
        self.proc = self.gateway = self.server = None
        try:  # die_on_exit: the JVM exits with this process; same process group (worker kills reach it)
            port, self.proc = launch_gateway(classpath=jar, javaopts=javaopts, die_on_exit=True, cwd=cwd, return_proc=True)
            self.gateway = JavaGateway(gateway_parameters=GatewayParameters(port=port, auto_field=True),
                                       java_process=self.proc)
            self.server = self.gateway.jvm.scienceworld.runtime.pythonapi.PythonInterface()
        except Exception as e:
            self.close()
            raise RuntimeError(f"could not start the ScienceWorld JVM (java on PATH? options {javaopts}): {e!r}") from e
        self.start_seconds = time.perf_counter() - t0

    @property
    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def close(self) -> None:
        gateway, proc = self.gateway, self.proc
        self.gateway = self.server = self.proc = None
        if gateway is not None:
            try:
                gateway.shutdown()
            except Exception:
                pass
        if proc is not None and proc.poll() is None:
            try:
                proc.stdin.close()  # EOF on stdin: py4j's die-on-exit watcher ends the JVM
                proc.wait(timeout=5)
            except (OSError, subprocess.TimeoutExpired):
                proc.kill()
                proc.wait(timeout=5)

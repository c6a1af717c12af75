"""The job description the controller writes for its workers (pure data, JSON on disk next to the pickled callables)."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from vpipe_lab.core import documents
from vpipe_lab.core.settings import Settings
from vpipe_lab.wire.private import write_private


@dataclass
class JobSpec:
    """One job as its workers see it: who to reach and how, its settings, its plan and where its files are."""

    session_id: str
    key: str
    address: str  # the controller's ZeroMQ endpoint
    master_addr: str
    master_port: int
    settings: Settings  # how the job trains (core/settings.py), validated before the job file was written
    plan: dict[str, Any] | None = None
    callables_path: str | None = None  # cloudpickle of user callables; written by the controller, never a socket
    job_dir: str | None = None  # where the controller writes the job's files: the only place a worker unpickles from
    examples: dict[str, str] = field(default_factory=dict)  # role -> bundled example name
    imports: dict[str, str] = field(default_factory=dict)  # role -> "package.module:attribute", imported by each worker
    split: list[str] | None = None  # module names where units begin, from a command line (launch() pickles its own)
    start_iteration: int = 0
    resume_path: str | None = None
    scout: bool = False  # rank 0 starts alone and reports the model's units (protocol UNITS) before the others start
    snapshot_dir: str | None = None  # restart snapshots and buffered batches (wire/snapshot_format.py); None: none taken
    restore_snapshot: str | None = None  # a restarted job: the snapshot directory every rank starts from
    devices: list[int] | None = None  # each rank's GPU index (None: rank r takes GPU r); a job that lost one skips it

    def save(self, path: Path) -> None:
        data = {**documents.dump(self), "settings": self.settings.to_json()}
        write_private(path, json.dumps(data, indent=1).encode())  # it holds the session key

    @classmethod
    def load(cls, path: Path) -> JobSpec:
        return documents.load_fields(cls, json.loads(path.read_text()), f"job file {path}", ValueError)

"""A session on a shared machine: what a local process without the key, a crafted checkpoint or the network can do
to it. Nothing of the session listens beyond loopback; a peer connecting under a worker's name takes no route (the
job trains on and every command answers); a torch.distributed.checkpoint folder whose ``.metadata`` would run code
is refused without running it (docs/security.md)."""

from __future__ import annotations

import pickle
from pathlib import Path

import psutil
import pytest
import zmq

import vpipe_lab
from vpipe_lab.wire.protocol import Message, encode, new_key

pytestmark = pytest.mark.slow


def listening(pids: set[int]) -> list[tuple[int, str]]:
    return [(c.pid, c.laddr.ip) for c in psutil.net_connections(kind="inet")
            if c.status == psutil.CONN_LISTEN and c.pid in pids]


def test_nothing_of_a_session_listens_beyond_loopback_and_nobody_without_the_key_takes_a_route() -> None:
    with vpipe_lab.launch("mlp", stages=2, microbatches=4, device="cpu", timeout=30) as session:
        session.run()
        session.wait(3, timeout=60)
        me = psutil.Process()
        pids = {me.pid} | {p.pid for p in me.children(recursive=True)}
        found = listening(pids)
        # the controller's endpoint, rank 0's rendezvous store and the process group's connections
        assert len({pid for pid, _ in found}) >= 3, found
        assert {ip for _, ip in found} == {"127.0.0.1"}, found
        address = session._hub.address
        ctx = zmq.Context()
        intruders = []
        try:
            for name in (b"rank0", b"rank1", b"controller"):
                sock = ctx.socket(zmq.DEALER)
                sock.setsockopt(zmq.IDENTITY, name)
                sock.connect(address)
                sock.send_multipart(encode(Message("hello", name.decode()), new_key()))
                intruders.append(sock)
            start = session.iteration
            session.wait(start + 5, timeout=60)  # training goes on
            at = session.pause()
            assert session.status == "paused" and at >= start + 5
            session.resume()
            session.wait(at + 3, timeout=60)
            assert session.profile(timeout=30).layers  # a command that needs an answer from every stage
            for sock in intruders:
                assert sock.poll(100) == 0  # nothing meant for a worker reached anyone without the key
        finally:
            for sock in intruders:
                sock.close(0)
            ctx.term()
        assert session.status == "running"


class _Payload:
    def __init__(self, marker: str) -> None:
        self.marker = marker

    def __reduce__(self):  # type: ignore[no-untyped-def]
        import os

        return (os.system, (f"touch {self.marker}",))


def test_resuming_a_dcp_folder_whose_metadata_would_run_code_is_refused_without_running_it(tmp_path: Path) -> None:
    folder = tmp_path / "foreign"
    folder.mkdir()
    marker = tmp_path / "ran"
    (folder / ".metadata").write_bytes(pickle.dumps(_Payload(str(marker))))
    with pytest.raises(Exception, match=r"never holds.*could run code"):
        vpipe_lab.launch("mlp", stages=2, microbatches=4, device="cpu", timeout=30, resume=folder)
    assert not marker.exists()


def test_resuming_a_checkpoint_whose_metadata_points_outside_it_is_refused_before_a_worker_reads(tmp_path: Path) -> None:
    """A version's ``.metadata`` rewritten to name a shard by an absolute path, the manifest's hash of it updated to
    match: resume refuses it, and the file outside is never read (its access time does not move)."""
    import dataclasses
    import json
    import os

    from vpipe_lab.runtime.disk.dcp_state import SafeReader
    from vpipe_lab.wire.checkpoint_format import resolve, sha256

    with vpipe_lab.launch("mlp", stages=2, microbatches=2, device="cpu", timeout=30) as s:
        s.run(1)
        s.wait(timeout=60)
        s.save(tmp_path / "ckpt")
    version = resolve(tmp_path / "ckpt")
    decoy = tmp_path / "decoy.distcp"
    decoy.write_bytes((version / "__1_0.distcp").read_bytes())
    os.utime(decoy, (1_000_000, 1_000_000))
    metadata = SafeReader(str(version)).read_metadata()
    metadata.storage_data = {k: dataclasses.replace(v, relative_path=str(decoy)) if v.relative_path == "__1_0.distcp"
                             else v for k, v in metadata.storage_data.items()}
    (version / ".metadata").write_bytes(pickle.dumps(metadata))
    manifest = json.loads((version / "manifest.json").read_text())
    manifest["files"][".metadata"] = sha256((version / ".metadata").read_bytes())
    (version / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(Exception, match=r"names the file .*decoy\.distcp.* not a plain file name inside the checkpoint"):
        vpipe_lab.launch("mlp", stages=2, microbatches=2, device="cpu", timeout=30, resume=tmp_path / "ckpt")
    assert os.stat(decoy).st_atime == 1_000_000

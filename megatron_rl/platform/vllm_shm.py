"""vLLM's shared memory on CPU: the communicator segments a process maps, freed at its end
and swept after a crash.

vLLM's CPU communicator keeps its segments in /dev/shm under names holding ``cpushm``.
Nothing removes them when a rank is killed, and a left-over segment makes the next launch
fail (errno 17); a process that ends without vLLM's shutdown (``launch.process_exit``) must
free its own. Here, under the platform layer, so that a process's end (``launch``) and the
engine (``rollout``) both reach it from below.
"""

from __future__ import annotations

from pathlib import Path

SHM_DIR = Path("/dev/shm")
SHM_MARKER = "cpushm"


def _names_in_maps(maps: str, unlinked_too: bool) -> set[str]:
    """The /dev/shm names a /proc/<pid>/maps text maps; a mapping shown "(deleted)" is one
    whose name is already unlinked (and may now be another file's), kept when ``unlinked_too``."""
    names = set()
    for line in maps.splitlines():
        if "/dev/shm/" in line and (unlinked_too or not line.endswith("(deleted)")):
            names.add(line.rsplit("/dev/shm/", 1)[1].replace(" (deleted)", "").strip())
    return names


def mapped_shm_names() -> set[str]:
    """Names of /dev/shm files that some live process has mapped."""
    names = set()
    for maps in Path("/proc").glob("[0-9]*/maps"):
        try:
            text = maps.read_text()
        except OSError:  # process gone or not ours
            continue
        names |= _names_in_maps(text, unlinked_too=True)
    return names


def release_shared_memory(shm_dir: Path = SHM_DIR) -> list[str]:
    """Free the shared memory vLLM's process groups hold in this process, for a process
    that ends without vLLM's shutdown (launch.process_exit); the names of the CPU
    communicator segments unlinked.

    Two kinds: the broadcast queue of each tensor-parallel group (Python shared memory,
    which the resource tracker would otherwise remove with a "leaked shared_memory objects"
    warning once the process is gone) goes with vLLM's own group teardown; the CPU
    communicator's segments, which nothing else removes, are unlinked by name."""
    from vllm.distributed.parallel_state import destroy_model_parallel

    destroy_model_parallel()
    return unlink_own_shm(shm_dir)


def unlink_own_shm(shm_dir: Path = SHM_DIR) -> list[str]:
    """Unlink the vLLM CPU communicator segments this process maps; return their names.

    For a process that ends without vLLM's shutdown (launch.process_exit). The mappings
    stay valid until the process is gone, and vLLM opens a segment by name only when an
    engine starts, so a rank of the same engine that is still running loses nothing. Two
    ranks of one engine map the same segments: the second finds them gone. A mapping shown
    "(deleted)" is already unlinked: its name may now be another file's."""
    removed = []
    for name in sorted(_names_in_maps(Path("/proc/self/maps").read_text(), unlinked_too=False)):
        if SHM_MARKER in name:
            try:
                (shm_dir / name).unlink()
                removed.append(name)
            except FileNotFoundError:  # the other rank of the engine was first
                pass
    return removed


def remove_stale_shm(shm_dir: Path = SHM_DIR) -> list[str]:
    """Delete vLLM CPU communicator segments that no live process maps; return their names."""
    if not shm_dir.is_dir():
        return []
    in_use = mapped_shm_names()
    removed = []
    for path in shm_dir.iterdir():
        if SHM_MARKER in path.name and path.name not in in_use:
            try:
                path.unlink()
                removed.append(path.name)
            except OSError:  # another rank removed it first, or not ours
                pass
    return removed

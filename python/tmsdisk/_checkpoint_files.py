# SPDX-License-Identifier: Apache-2.0
"""The files of tmsdisk.optim's streaming checkpoints (save(directory) / load(directory)): written whole
and fsync'd with their directory, each checked against the SHA-256 its manifest records before a byte
of it is used."""

import hashlib
import json
import os

CHECKPOINT_FORMAT = 1
CHECKPOINT_MANIFEST = "manifest.json"


def _read_manifest(cls, directory) -> dict:
    """The manifest of the checkpoint in `directory`, of this format and of class `cls`; ValueError
    saying what is wrong (no checkpoint there, not a manifest, another format or class)."""
    path = os.path.join(directory, CHECKPOINT_MANIFEST)
    try:
        with open(path, "rb") as f:
            manifest = json.loads(f.read().decode())
    except FileNotFoundError:
        raise ValueError("%s.load: %s has no checkpoint: %s is missing" % (cls, directory, CHECKPOINT_MANIFEST))
    except ValueError as e:
        raise ValueError("%s.load: %s is not a checkpoint manifest: %s" % (cls, path, e))
    if not isinstance(manifest, dict) or manifest.get("format") != CHECKPOINT_FORMAT:
        raise ValueError("%s.load: %s: format %r, this version reads format %d" % (
            cls, path, manifest.get("format") if isinstance(manifest, dict) else None, CHECKPOINT_FORMAT))
    if manifest.get("class") != cls:
        raise ValueError("%s.load: the checkpoint is of %s, not %s" % (cls, manifest.get("class"), cls))
    return manifest


def _fsync_directory(directory) -> None:
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _write_file(directory, name, data) -> str:
    """`data` (a buffer) to directory/name through a temporary name, fsynced, renamed; its SHA-256."""
    final = os.path.join(directory, name)
    tmp = final + ".%d.tmp" % os.getpid()
    view = memoryview(data).cast("B")
    digest = hashlib.sha256()
    try:
        with open(tmp, "wb") as f:
            step = 64 << 20
            for at in range(0, len(view), step):
                piece = view[at : at + step]
                f.write(piece)
                digest.update(piece)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, final)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise
    return digest.hexdigest()


def _open_checkpoint_file(cls, directory, entry, nbytes, what):
    path = os.path.join(directory, os.path.basename(str(entry.get("file"))))
    try:
        f = open(path, "rb")
    except FileNotFoundError:
        raise ValueError("%s.load: %s's file %s is missing" % (cls, what, path))
    size = os.fstat(f.fileno()).st_size
    if size != nbytes:
        f.close()
        raise ValueError("%s.load: %s's file %s has %d bytes, the bucket %d" % (cls, what, path, size, nbytes))
    return f, path


def _check_file(cls, directory, entry, nbytes, what) -> None:
    """The file of a bucket is there, of its size, with the manifest's SHA-256 (read in pieces)."""
    f, path = _open_checkpoint_file(cls, directory, entry, nbytes, what)
    digest = hashlib.sha256()
    with f:
        for piece in iter(lambda: f.read(16 << 20), b""):
            digest.update(piece)
    if digest.hexdigest() != entry.get("sha256"):
        raise ValueError("%s.load: %s's file %s fails its check: SHA-256 %s, the manifest says %s" % (
            cls, what, path, digest.hexdigest(), entry.get("sha256")))


def _read_file(cls, directory, entry, array, what) -> None:
    """The file of a bucket into `array` (its bytes), its SHA-256 checked again."""
    f, path = _open_checkpoint_file(cls, directory, entry, array.nbytes, what)
    view = memoryview(array).cast("B")
    with f:
        at = 0
        while at < len(view):
            n = f.readinto(view[at:])
            if not n:
                raise ValueError("%s.load: %s's file %s ended early" % (cls, what, path))
            at += n
    if hashlib.sha256(view).hexdigest() != entry.get("sha256"):
        raise ValueError("%s.load: %s's file %s fails its check: its SHA-256 is not the manifest's" % (
            cls, what, path))


def _layout_difference(theirs, mine) -> str:
    if not isinstance(theirs, dict):
        return "the manifest has none"
    if theirs.get("bucket_elements") != mine["bucket_elements"]:
        return "bucket_elements %r, this optimizer's %r" % (theirs.get("bucket_elements"), mine["bucket_elements"])
    tg, mg = theirs.get("groups") or [], mine["groups"]
    if len(tg) != len(mg):
        return "%d parameter groups, this optimizer has %d" % (len(tg), len(mg))
    for g, (t, m) in enumerate(zip(tg, mg)):
        if t.get("params") != m["params"]:
            return "the parameters of group %d are %s, this optimizer's %s" % (g, t.get("params"), m["params"])
        if t.get("buckets") != m["buckets"]:
            return "the buckets of group %d are cut otherwise" % g
    return "it is not this optimizer's"

"""`splitserve keygen FILE [FILE ...]`: a random secret in each FILE that does not exist yet, for
the router's API keys, admin keys or the cluster secret (docs/security.md).

    splitserve keygen secrets/api-keys secrets/admin-keys secrets/cluster-secret
    splitserve router ... --api-keys-file secrets/api-keys --admin-keys-file secrets/admin-keys

Each new file gets one key, `ss-` + `secrets.token_urlsafe(32)` (256 random bits; the prefix keeps
a key from starting with `-`, which `--api-key KEY` would read as a flag), and mode 0600; missing
folders on its path are made (mode 0700). A FILE that exists is left as it is, so running it again
(compose's `keys` service at every `up`) keeps the keys clients already hold. One line per FILE;
the key itself is never printed: read it from the file. Exit 1 when a FILE cannot be written.
Also runnable alone: `python -m splitserve.cli.keygen_cmd FILE ...`.
"""

from __future__ import annotations

import argparse
import os
import secrets
import stat
import sys
from pathlib import Path

KEY_BYTES = 32  # token_urlsafe(32): 43 characters, well above credentials.MIN_SECRET_LEN
KEY_PREFIX = "ss-"  # a letter first: a urlsafe key starts with '-' one time in 64


def new_key() -> str:
    return KEY_PREFIX + secrets.token_urlsafe(KEY_BYTES)


def register(sub) -> None:
    p = sub.add_parser(
        "keygen", help="write a random API key / cluster secret into each FILE not there yet"
    )
    add_arguments(p)
    p.set_defaults(func=run)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("files", nargs="+", metavar="FILE", help="file to create (kept if it exists)")


def write_new_key(path: Path) -> bool:
    """Writes a fresh key to `path` unless it exists; True when written. OSError when it cannot."""
    missing = [folder for folder in (path.parent, *path.parent.parents) if not folder.exists()]
    for folder in reversed(missing):  # every folder made here is private to its owner
        folder.mkdir(mode=0o700, exist_ok=True)
    try:
        # O_EXCL: never overwrite, and never follow a symlink planted at `path`
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    except FileExistsError:
        return False
    try:
        os.fchmod(fd, 0o600)  # exactly 0600, whatever the umask
        os.write(fd, (new_key() + "\n").encode())
    except OSError:
        os.close(fd)
        path.unlink(missing_ok=True)  # no empty key file left behind for a router to read
        raise
    os.close(fd)
    return True


def _describe_existing(path: Path) -> str:
    st = path.lstat()
    if not stat.S_ISREG(st.st_mode):
        return f"{path}: exists and is not a regular file; left as it is"
    if st.st_mode & 0o077:
        return f"{path}: exists, kept (readable by others: chmod 600 {path})"
    return f"{path}: exists, kept"


def run(args: argparse.Namespace) -> int:
    failed = 0
    for name in args.files:
        path = Path(name)
        try:
            if write_new_key(path):
                print(f"{path}: new key written (mode 0600)", flush=True)
            else:
                print(_describe_existing(path), flush=True)
        except OSError as exc:
            failed += 1
            print(f"splitserve keygen: error: cannot write {path}: {exc.strerror}", file=sys.stderr)
    return 1 if failed else 0


def main(argv: list[str] | None = None) -> int:
    from splitserve.cli.standalone import standalone_main

    return standalone_main("keygen", __doc__, add_arguments, run, argv)


if __name__ == "__main__":
    sys.exit(main())

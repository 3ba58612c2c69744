#!/bin/sh
# The "ssh" of emulated nodes (tests/helpers/emunodes.py): hydra's ssh launcher calls
#   SHIM [-x ...] HOST "COMMAND ..."
# This drops the leading options, takes HOST (a network namespace made by emunodes.py) and runs
# COMMAND in it under a fresh UTS namespace whose host name is HOST, so MPI_Get_processor_name and
# the suite's node detection see one node per namespace.
while [ $# -gt 0 ]; do
    case "$1" in
        -*) shift ;;
        *) break ;;
    esac
done
host="$1"
shift
if [ -z "$host" ] || ! ip netns list | grep -q "^$host\( \|$\)"; then
    echo "netns_shim: no emulated node named '$host' (bring it up with tests/helpers/emunodes.py up)" >&2
    exit 255
fi
exec ip netns exec "$host" unshare --uts sh -c "hostname $host; $*"

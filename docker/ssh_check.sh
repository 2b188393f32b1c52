#!/usr/bin/env bash
# Checks, inside the image, the ssh set-up that multi-host launches rely on (run by
# docker/build_and_test.sh): sshd's configuration (port 12345, public-key login only), a key
# login with the image's PATH on the remote side, no login without a key, and an mpirun job
# whose daemon is launched through ssh. sshd listens on 127.0.0.2 only (OpenMPI then treats it
# as a remote host) and is stopped when the check ends.
set -euo pipefail
d=/tmp/hvd-ssh-check
keys=/root/.ssh/authorized_keys
rm -rf "$d"; mkdir -p "$d" /root/.ssh
# The check logs in with a key of its own; keys already there (a worker's mounted shared key)
# are put back as they were when it ends.
if [ -e "$keys" ]; then cp -p "$keys" "$d/authorized_keys.saved"; fi
cleanup() {
  [ -f "$d/sshd.pid" ] && kill "$(cat "$d/sshd.pid")" 2>/dev/null
  if [ -e "$d/authorized_keys.saved" ]; then cp -p "$d/authorized_keys.saved" "$keys"; else rm -f "$keys"; fi
}
trap cleanup EXIT

ssh-keygen -q -t ed25519 -N '' -f "$d/id_ed25519"
cp "$d/id_ed25519.pub" "$keys"
ssh-keygen -A >/dev/null
/usr/sbin/sshd -t
/usr/sbin/sshd -o ListenAddress=127.0.0.2 -o PidFile="$d/sshd.pid"
for _ in $(seq 50); do [ -s "$d/sshd.pid" ] && break; sleep 0.1; done
[ -s "$d/sshd.pid" ] || { echo "sshd did not start" >&2; exit 1; }

port=$(/usr/sbin/sshd -T | awk '$1 == "port" {print $2}')
echo "sshd: $(/usr/sbin/sshd -T | grep -E '^(port|pubkeyauthentication|passwordauthentication|kbdinteractiveauthentication|permitrootlogin) ' | tr '\n' ' ')"
[ "$port" = "${HVD_TOPK_SSH_PORT:-12345}" ] || { echo "sshd port is $port" >&2; exit 1; }

echo "key login; tools on the remote PATH:"
ssh -i "$d/id_ed25519" root@127.0.0.2 'command -v python orted horovodrun'

if ssh -o PubkeyAuthentication=no root@127.0.0.2 true 2>"$d/nokey.err"; then
  echo "a login without a key was accepted" >&2; exit 1
fi
grep -q 'Permission denied (publickey)' "$d/nokey.err" \
  || { cat "$d/nokey.err" >&2; echo "sshd offers more than public-key login" >&2; exit 1; }
echo "login without a key refused: $(tr -d '\r\n' < "$d/nokey.err")"

# An ssh wrapper that leaves a mark, to prove mpirun went through ssh (and so through port 12345).
printf '#!/bin/sh\ntouch %s/used\nexec ssh -i %s/id_ed25519 "$@"\n' "$d" "$d" > "$d/ssh.sh"
chmod +x "$d/ssh.sh"
echo "mpirun -np 2 -H 127.0.0.2:2 through ssh (port and PATH from the image's ssh configs):"
mpirun -np 2 -H 127.0.0.2:2 -mca plm_rsh_agent "$d/ssh.sh" \
  python -c 'import horovod.torch as hvd, torch
hvd.init()
s = hvd.allreduce(torch.ones(3) * (hvd.rank() + 1), op=hvd.Sum)
assert s.tolist() == [3.0] * 3, s
print("rank", hvd.rank(), "of", hvd.size(), "allreduce ok")'
[ -f "$d/used" ] || { echo "mpirun did not launch through ssh" >&2; exit 1; }
echo "ssh check OK"

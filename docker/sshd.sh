#!/bin/sh
# hvd-sshd: start the image's ssh server in the foreground, for multi-host Horovod/OpenMPI runs.
#   docker run -d --network host -v /path/to/shared-ssh:/root/.ssh:ro IMAGE hvd-sshd
# Port and login rules are in /etc/ssh/sshd_config.d/hvd_topk.conf (port 12345, public-key
# login only, keys from /root/.ssh/authorized_keys). Extra arguments go to sshd (e.g. -p 2222).
set -eu
ssh-keygen -A >/dev/null          # host keys are made per container, never shipped in the image
mkdir -p /run/sshd
if [ ! -s /root/.ssh/authorized_keys ]; then
  echo "hvd-sshd: warning: /root/.ssh/authorized_keys is missing or empty; mount the shared key" \
       "directory at /root/.ssh (docs/install.md#docker-image-and-multi-node)" >&2
fi
/usr/sbin/sshd -t "$@"
echo "hvd-sshd: listening on port $(/usr/sbin/sshd -T "$@" | awk '$1 == "port" {print $2; exit}'), public-key login only" >&2
exec /usr/sbin/sshd -D -e "$@"

#!/bin/sh
# What a process may do, one "name: allowed|refused" line each (tests/l5_service/test_hardening.py runs it as a
# transient unit with dflash-train.service's hardening and as plain root, in the unprivileged lab CT).
r() { "$@" >/dev/null 2>&1 && echo allowed || echo refused; }
echo "run as root: $( [ "$(id -u)" = 0 ] && echo allowed || echo refused)"
echo "gain privileges (NoNewPrivs 0): $(grep -q '^NoNewPrivs:.*0$' /proc/self/status && echo allowed || echo refused)"
echo "hold capabilities: $(grep -q '^CapBnd:.*0000000000000000$' /proc/self/status && echo refused || echo allowed)"
echo "write /usr: $(r touch /usr/.dflash-probe)"
echo "write /etc: $(r touch /etc/.dflash-probe)"
echo "read /root: $(r ls /root)"
echo "see other /tmp files: $( [ -e /tmp/.dflash-probe-outside ] && echo allowed || echo refused)"
echo "new user namespace: $(r unshare -U true)"
echo "change personality: $(r setarch linux32 true)"
echo "write /proc/sys: $(r sh -c 'echo 1 > /proc/sys/kernel/sysrq')"
echo "write /sys/fs/cgroup: $(r mkdir /sys/fs/cgroup/dflash-probe)"
echo "read /dev/kmsg: $(r head -c1 /dev/kmsg)"
echo "realtime scheduling: $(r chrt -f 1 true)"
rm -f /usr/.dflash-probe /etc/.dflash-probe 2>/dev/null; rmdir /sys/fs/cgroup/dflash-probe 2>/dev/null; true

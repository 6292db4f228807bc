# Sourced by the scripts that start processes on 127.0.0.1: ports free right now (python3).
#   source scripts/ports.sh;  port=$(free_port);  base=$(free_ports 4)   # base .. base+3 free
free_port() { python3 -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])'; }
# A random base, so two calls before either range is taken (two kvmocker processes started one
# after the other) do not name the same ports.
free_ports() {  # n: the first of n consecutive ports free right now (a kvmocker's HTTP faces)
  python3 - "$1" <<'PY'
import random, socket, sys
n = int(sys.argv[1])
while True:
    base = random.randrange(20000, 60000 - n)
    socks = []
    try:
        for p in range(base, base + n):
            s = socket.socket(); s.bind(("127.0.0.1", p)); socks.append(s)
        print(base); break
    except OSError:
        pass
    finally:
        for s in socks: s.close()
PY
}

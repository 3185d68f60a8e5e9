# One execution's way into its context's driver (interp_driver.py): run by
# the adapter as `python3 -I -S -c CLIENT SOCKET WAIT` with the request on
# stdin, it connects to the driver's abstract unix socket (retrying for up
# to WAIT seconds while the driver starts or runs another cell's accept),
# sends the request length-prefixed and copies the driver's events to
# stdout until the driver closes the connection. Killing it (the HTTP
# request went away) closes the connection, which interrupts the cell.
import os, socket, sys, time
name, wait = sys.argv[1], float(sys.argv[2])
req = sys.stdin.buffer.read()
deadline = time.monotonic() + wait
while True:
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        s.connect("\0" + name)
        break
    except OSError as e:
        s.close()
        if time.monotonic() > deadline:
            sys.stderr.write("connect to the context's driver: %s\n" % e)
            sys.exit(3)
        time.sleep(0.05)
s.sendall(len(req).to_bytes(8, "big") + req)
while True:
    b = s.recv(1 << 16)
    if not b:
        break
    os.write(1, b)

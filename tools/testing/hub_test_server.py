#!/usr/bin/env python3
"""A local stand-in for the Hugging Face Hub's file endpoint, for the Swift BundleDownloader tests.

Serves ROOT in the Hub layout ``/<repo_id>/resolve/<revision>/<path>`` (revision: ``--revision`` or
the ``--commit`` hash it announces in ``X-Repo-Commit``), with HTTP Range requests (206). Binds
127.0.0.1 on a free port and prints the port as its first stdout line. Exits when stdin closes (so a
crashed test run leaves no server behind) or on SIGTERM.

Fault injection (PATH relative to ROOT, e.g. ``f16/vocab.json``; each flag may repeat):
  --missing PATH     404
  --truncate PATH    full Content-Length, connection closed after half the body
  --flip PATH        one byte (the middle one) flipped
  --drop-once PATH   the first request closes the connection after --drop-after bytes; later ones are served
  --slow PATH        the body in 1 KiB pieces, 20 ms apart
  --no-range         ignore Range headers (always 200 with the whole file)
  --token TOKEN      401 unless ``Authorization: Bearer TOKEN``
Every request is appended to --log as a JSON line: {"path", "range", "auth", "status"} (``auth`` is
whether an Authorization header came, never its value).

Python standard library only.
"""
from __future__ import annotations

import argparse
import json
import os
import socket
import sys
import threading
import time
import urllib.parse
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer


def parse_args(argv):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--root", required=True)
    p.add_argument("--repo-id", default="test-org/test-model")
    p.add_argument("--revision", default="main")
    p.add_argument("--commit", default="0123456789abcdef0123456789abcdef01234567")
    p.add_argument("--log", default=None)
    p.add_argument("--missing", action="append", default=[])
    p.add_argument("--truncate", action="append", default=[])
    p.add_argument("--flip", action="append", default=[])
    p.add_argument("--drop-once", action="append", default=[])
    p.add_argument("--drop-after", type=int, default=None, help="bytes before a --drop-once close (default: half)")
    p.add_argument("--slow", action="append", default=[])
    p.add_argument("--no-range", action="store_true")
    p.add_argument("--token", default=None)
    return p.parse_args(argv)


class Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    server_version = "hub-test-server"

    def log_message(self, format, *args):  # quiet: stdout carries the port, stderr stays clean
        pass

    def record(self, status):
        cfg = self.server.cfg
        if not cfg.log:
            return
        line = json.dumps({"path": urllib.parse.unquote(urllib.parse.urlsplit(self.path).path),
                           "range": self.headers.get("Range"),
                           "auth": self.headers.get("Authorization") is not None,
                           "status": status})
        with self.server.lock:
            with open(cfg.log, "a", encoding="utf-8") as f:
                f.write(line + "\n")

    def send_plain(self, status, text):
        body = text.encode()
        self.record(status)
        self.send_response(status)
        self.send_header("Content-Type", "text/plain")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def resolve(self):
        """The file path relative to ROOT, or None."""
        cfg = self.server.cfg
        path = urllib.parse.urlsplit(self.path).path
        prefix = f"/{cfg.repo_id}/resolve/"
        if not path.startswith(prefix):
            return None
        revision, _, rest = path[len(prefix):].partition("/")
        if urllib.parse.unquote(revision) not in (cfg.revision, cfg.commit) or not rest:
            return None
        parts = [urllib.parse.unquote(p) for p in rest.split("/")]
        if any(p in ("", ".", "..") or "/" in p or "\\" in p for p in parts):
            return None
        return "/".join(parts)

    def close_now(self):
        self.close_connection = True
        try:
            self.wfile.flush()
            self.connection.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass

    def do_GET(self):
        cfg = self.server.cfg
        if cfg.token is not None and self.headers.get("Authorization") != f"Bearer {cfg.token}":
            return self.send_plain(401, "unauthorized")
        rel = self.resolve()
        if rel is None or rel in cfg.missing:
            return self.send_plain(404, "not found")
        full = os.path.join(cfg.root, *rel.split("/"))
        if not os.path.isfile(full):
            return self.send_plain(404, "not found")
        with open(full, "rb") as f:
            data = bytearray(f.read())
        if rel in cfg.flip and data:
            data[len(data) // 2] ^= 0xFF
        size = len(data)

        start, status = 0, 200
        header = self.headers.get("Range")
        if header and not cfg.no_range and header.startswith("bytes="):
            first, _, last = header[len("bytes="):].partition("-")
            if first.isdigit() and (last == "" or last.isdigit()):
                start = int(first)
                end = int(last) if last else size - 1
                if start >= size:
                    self.record(416)
                    self.send_response(416)
                    self.send_header("Content-Range", f"bytes */{size}")
                    self.send_header("Content-Length", "0")
                    self.end_headers()
                    return
                data = data[start:min(end, size - 1) + 1]
                status = 206
        self.record(status)
        self.send_response(status)
        self.send_header("Content-Type", "application/octet-stream")
        self.send_header("Content-Length", str(len(data)))
        self.send_header("Accept-Ranges", "bytes")
        self.send_header("X-Repo-Commit", cfg.commit)
        if status == 206:
            self.send_header("Content-Range", f"bytes {start}-{start + len(data) - 1}/{size}")
        self.end_headers()

        if rel in cfg.truncate:
            self.wfile.write(bytes(data[: len(data) // 2]))
            return self.close_now()
        if rel in cfg.drop_once:
            with self.server.lock:
                first_time = rel not in self.server.dropped
                self.server.dropped.add(rel)
            if first_time:
                n = cfg.drop_after if cfg.drop_after is not None else len(data) // 2
                self.wfile.write(bytes(data[:n]))
                return self.close_now()
        if rel in cfg.slow:
            for i in range(0, len(data), 1024):
                self.wfile.write(bytes(data[i:i + 1024]))
                self.wfile.flush()
                time.sleep(0.02)
            return
        self.wfile.write(bytes(data))


def main(argv=None):
    cfg = parse_args(sys.argv[1:] if argv is None else argv)
    cfg.root = os.path.abspath(cfg.root)
    for name in ("missing", "truncate", "flip", "drop_once", "slow"):
        setattr(cfg, name, set(getattr(cfg, name)))
    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    server.daemon_threads = True
    server.cfg = cfg
    server.lock = threading.Lock()
    server.dropped = set()
    print(server.server_address[1], flush=True)

    def watch_stdin():
        try:
            while sys.stdin.buffer.read(4096):
                pass
        except (OSError, ValueError):
            pass
        os._exit(0)

    threading.Thread(target=watch_stdin, daemon=True).start()
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        pass


if __name__ == "__main__":
    main()

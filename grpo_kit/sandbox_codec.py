"""The wire format between a candidate's process and its tests' process (:func:`grpo_kit.sandbox.run_tests`).

Every value is JSON: None, bool, str and ints below 2**53 as themselves, the rest as ``[tag, payload]``;
a message is a 4-byte length, then its JSON. This module runs in three places: imported by
:mod:`grpo_kit.sandbox` (the parent's :func:`encode_plain` and :func:`decode_plain`), and as source
text inside both sandboxes, where the launcher (``sandbox_launcher.py``, run as ``python -I -S``: no
site-packages, no ``grpo_kit``) executes it. So it imports nothing beyond the standard library.

>>> decode_plain(encode_plain({(1, 2.5): [b"x", None, {3j}]}))
{(1, 2.5): [b'x', None, {3j}]}
"""

import json
import os

MAX_DEPTH = 100
_TAGS = {list: "l", tuple: "t", set: "s", frozenset: "z"}
_BUILD = {"l": list, "t": tuple, "s": set, "z": frozenset}


def encode_plain(x, depth=0):
    """``x`` as JSON-able data, exactly (tuple or list, inf, nan, -0.0, big ints); TypeError for
    anything not plain (a subclass of int is not an int here), ValueError when nested too deeply."""
    t = type(x)
    if x is None or t is bool or t is str:
        return x
    if t is int:
        return x if -(1 << 53) < x < (1 << 53) else ["i", hex(x)]
    if t is float:
        return ["f", x.hex()]
    if t is complex:
        return ["c", [x.real.hex(), x.imag.hex()]]
    if t is bytes:
        return ["b", x.hex()]
    if t not in _TAGS and t is not dict:
        raise TypeError(f"a {t.__name__} is not plain data")
    if depth >= MAX_DEPTH:
        raise ValueError(f"nested deeper than {MAX_DEPTH}")
    if t is dict:
        return ["d", [[encode_plain(k, depth + 1), encode_plain(v, depth + 1)] for k, v in x.items()]]
    return [_TAGS[t], [encode_plain(v, depth + 1) for v in x]]


def decode_plain(v, depth=0):
    """The value :func:`encode_plain` encoded; builds only plain types and raises ValueError or
    TypeError (an unhashable key) for anything else."""
    t = type(v)
    if v is None or t is bool or t is str:
        return v
    if t is int:
        if -(1 << 53) < v < (1 << 53):
            return v
        raise ValueError("a bare int out of range")
    if t is not list or len(v) != 2 or type(v[0]) is not str:
        raise ValueError("not an encoded value")
    tag, p = v
    if tag == "i" and type(p) is str:
        return int(p, 16)
    if tag == "f" and type(p) is str and len(p) <= 32:
        return float.fromhex(p)
    if tag == "c" and type(p) is list and len(p) == 2 and type(p[0]) is str and type(p[1]) is str:
        return complex(decode_plain(["f", p[0]]), decode_plain(["f", p[1]]))
    if tag == "b" and type(p) is str:
        return bytes.fromhex(p)
    if type(p) is not list or depth >= MAX_DEPTH:
        raise ValueError("not an encoded value")
    if tag == "d":
        out = {}
        for kv in p:
            if type(kv) is not list or len(kv) != 2:
                raise ValueError("not an encoded dict item")
            out[decode_plain(kv[0], depth + 1)] = decode_plain(kv[1], depth + 1)
        return out
    if tag not in _BUILD:
        raise ValueError(f"unknown tag {tag[:20]!r}")
    return _BUILD[tag](decode_plain(x, depth + 1) for x in p)


def _no_json(text):
    raise ValueError("JSON floats and objects are not part of the format")


def send_message(fd, msg):
    """One message: a 4-byte length, then its JSON."""
    body = json.dumps(msg).encode()
    data = len(body).to_bytes(4, "big") + body
    while data:
        data = data[os.write(fd, data):]


def recv_message(fd, limit):
    """The next message, or None at end of file; ValueError when it is over ``limit`` bytes or not
    strict JSON of lists, strings, ints, booleans and null."""
    head = _read_exact(fd, 4)
    if head is None:
        return None
    n = int.from_bytes(head, "big")
    if n > limit:
        raise ValueError(f"a message of {n} bytes (over {limit})")
    body = _read_exact(fd, n)
    if body is None:
        return None
    return json.loads(body.decode("ascii"), parse_float=_no_json, parse_constant=_no_json,
                       object_pairs_hook=_no_json)


def _read_exact(fd, n):
    parts, got = [], 0
    while got < n:
        chunk = os.read(fd, min(n - got, 1 << 20))
        if not chunk:
            return None
        parts.append(chunk)
        got += len(chunk)
    return b"".join(parts)

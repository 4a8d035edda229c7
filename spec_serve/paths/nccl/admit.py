"""Admit only given source addresses to a listening TCP socket: the bound worker's rendezvous store.

A ``TCPStore`` authenticates nobody, and any peer that joins it can list, read and overwrite its keys
(the pair group's addresses among them). So the worker's store takes connections only from its bound
client's address (and its own: the store's master connects to itself): a classic BPF socket filter on
the listener drops every packet, SYNs included, from any other source address, in the kernel, before a
connection exists. Accepted connections inherit the filter. Linux only (``SO_ATTACH_FILTER``); elsewhere
``admit_only`` raises ``OSError`` and the worker refuses the binding.

Invariant: a socket filtered here reads no byte from an address outside ``addresses``.
"""

from __future__ import annotations

import ctypes
import ipaddress
import socket
import struct
from collections.abc import Iterable

SO_ATTACH_FILTER = 26
# Classic BPF: load a 32-bit word at an absolute offset, jump if equal to k, return k.
_LD_W_ABS, _JEQ_K, _RET_K = 0x20, 0x15, 0x06
_NET_OFF = -0x100000  # SKF_NET_OFF: offsets from the network (IP) header, not the TCP header
_SOURCE_OFFSET = {socket.AF_INET: 12, socket.AF_INET6: 8}  # the source address in an IPv4 / IPv6 header


def filter_program(family: socket.AddressFamily, addresses: Iterable[str]) -> list[tuple[int, int, int, int]]:
    """(code, jt, jf, k) instructions that accept a packet whose source is one of ``addresses`` (of
    ``family``) and drop any other: a block of word compares per address, then drop, then accept."""
    size = 4 if family == socket.AF_INET else 16
    blocks = []
    for address in addresses:
        packed = ipaddress.ip_address(address.split("%")[0]).packed
        if len(packed) != size:
            raise ValueError(f"{address} is not an address of the store's family")
        blocks.append([int.from_bytes(packed[i:i + 4], "big") for i in range(0, size, 4)])
    accept = sum(2 * len(words) for words in blocks) + 1
    program, at = [], 0
    for words in blocks:
        end = at + 2 * len(words)  # the next block
        for j, word in enumerate(words):
            program.append((_LD_W_ABS, 0, 0, (_NET_OFF + _SOURCE_OFFSET[family] + 4 * j) & 0xFFFFFFFF))
            at += 2
            program.append((_JEQ_K, accept - at if j == len(words) - 1 else 0, end - at, word))
    return [*program, (_RET_K, 0, 0, 0), (_RET_K, 0, 0, 0xFFFFFFFF)]


def admit_only(listener: socket.socket, addresses: Iterable[str]) -> None:
    """Make ``listener`` (before it accepts anything) drop packets from every source but ``addresses``."""
    program = filter_program(socket.AddressFamily(listener.family), addresses)
    code = ctypes.create_string_buffer(b"".join(struct.pack("HBBI", *ins) for ins in program))
    # struct sock_fprog {unsigned short len; struct sock_filter *filter;}; the kernel copies the program.
    listener.setsockopt(socket.SOL_SOCKET, SO_ATTACH_FILTER, struct.pack("@HP", len(program), ctypes.addressof(code)))

"""The system calls a grading child may not make, as a seccomp filter that bubblewrap loads (`--seccomp FD`).

Inside the walls (`autograder.walls`) the child is already an unprivileged user with no capabilities; this
filter refuses, with EPERM, the calls that would change what it is or what it sees, so that a kernel's
default (unprivileged user namespaces, ptrace of one's own processes) is not part of the wall:

- namespaces and mounts: `unshare`, `setns`, `clone` with any `CLONE_NEW*` flag, `mount`, `umount2`,
  `pivot_root`, `chroot` and the new mount API (`fsopen` ... `mount_setattr`); `clone3` answers ENOSYS so
  that the C library falls back to `clone`, whose flags the filter can read;
- reading or steering other processes: `ptrace`, `process_vm_readv`, `process_vm_writev`;
- privilege changes: the `set*id` family, `setgroups`, `capset`;
- kernel facilities a grading run never needs: keyrings, `bpf`, `perf_event_open`, `userfaultfd`,
  modules, `kexec`, file handles.

A call from another ABI than the machine's (i386 or x32 on x86_64) kills the process, so the list cannot
be bypassed by number. The filter is written for x86_64, the architecture these machines and CI run; on
another one `program()` returns None and the walls say the filter is missing (bubblewrap's namespaces
and the dropped user still hold).

The program is classic BPF (linux/filter.h, linux/seccomp.h): each instruction is
`struct sock_filter { u16 code; u8 jt; u8 jf; u32 k; }`, run on `struct seccomp_data`
(`nr` at offset 0, `arch` at 4, `args[i]` at 16 + 8i).
"""

from __future__ import annotations

import errno
import platform
import struct

AUDIT_ARCH_X86_64 = 0xC000003E
X32_SYSCALL_BIT = 0x40000000

RET_KILL_PROCESS = 0x80000000
RET_ERRNO = 0x00050000
RET_ALLOW = 0x7FFF0000

LD_W_ABS = 0x20  # BPF_LD | BPF_W | BPF_ABS
JEQ_K = 0x15  # BPF_JMP | BPF_JEQ | BPF_K
JGE_K = 0x35  # BPF_JMP | BPF_JGE | BPF_K
JSET_K = 0x45  # BPF_JMP | BPF_JSET | BPF_K
RET_K = 0x06  # BPF_RET | BPF_K

CLONE_NAMESPACES = 0x7E020000
"""CLONE_NEWNS | CLONE_NEWCGROUP | CLONE_NEWUTS | CLONE_NEWIPC | CLONE_NEWUSER | CLONE_NEWPID | CLONE_NEWNET."""

X86_64_REFUSED = {
    "ptrace": 101,
    "syslog": 103,
    "setuid": 105,
    "setgid": 106,
    "setreuid": 113,
    "setregid": 114,
    "setgroups": 116,
    "setresuid": 117,
    "setresgid": 119,
    "setfsuid": 122,
    "setfsgid": 123,
    "capset": 126,
    "personality": 135,
    "pivot_root": 155,
    "chroot": 161,
    "acct": 163,
    "mount": 165,
    "umount2": 166,
    "init_module": 175,
    "delete_module": 176,
    "kexec_load": 246,
    "add_key": 248,
    "request_key": 249,
    "keyctl": 250,
    "unshare": 272,
    "perf_event_open": 298,
    "name_to_handle_at": 303,
    "open_by_handle_at": 304,
    "setns": 308,
    "process_vm_readv": 310,
    "process_vm_writev": 311,
    "finit_module": 313,
    "kexec_file_load": 320,
    "bpf": 321,
    "userfaultfd": 323,
    "open_tree": 428,
    "move_mount": 429,
    "fsopen": 430,
    "fsconfig": 431,
    "fsmount": 432,
    "fspick": 433,
    "mount_setattr": 442,
}
"""Refused with EPERM (numbers from the kernel's arch/x86/entry/syscalls/syscall_64.tbl)."""
X86_64_CLONE = 56
X86_64_CLONE3 = 435


def _instruction(code: int, k: int, jt: int = 0, jf: int = 0) -> bytes:
    return struct.pack("<HBBI", code, jt, jf, k)


def x86_64_program() -> bytes:
    """The filter for x86_64, as the bytes bubblewrap reads from `--seccomp FD`."""
    refuse = RET_ERRNO | errno.EPERM
    checks = sorted(X86_64_REFUSED.values())
    # Layout: arch check (3), load nr (1), x32 check (1), one jump per refused call, clone (3), clone3 (1),
    # then: allow, refuse, no-such-call, kill.
    body: list[tuple[int, int, str | None]] = []  # (code, k, label the true branch jumps to)
    body += [(JGE_K, X32_SYSCALL_BIT, "kill")]
    body += [(JEQ_K, number, "refuse") for number in checks]
    body += [(JEQ_K, X86_64_CLONE3, "enosys"), (JEQ_K, X86_64_CLONE, "clone")]
    head = [
        _instruction(LD_W_ABS, 4),
        _instruction(JEQ_K, AUDIT_ARCH_X86_64, jt=1, jf=0),
        _instruction(RET_K, RET_KILL_PROCESS),
        _instruction(LD_W_ABS, 0),
    ]
    tail_labels = ["allow", "refuse", "enosys", "kill", "clone"]
    tail = {
        "allow": [_instruction(RET_K, RET_ALLOW)],
        "refuse": [_instruction(RET_K, refuse)],
        "enosys": [_instruction(RET_K, RET_ERRNO | errno.ENOSYS)],
        "kill": [_instruction(RET_K, RET_KILL_PROCESS)],
        "clone": [
            _instruction(LD_W_ABS, 16),  # the low 32 bits of args[0], the flags
            _instruction(JSET_K, CLONE_NAMESPACES, jt=1, jf=0),
            _instruction(RET_K, RET_ALLOW),
            _instruction(RET_K, refuse),
        ],
    }
    offsets, position = {}, len(body)
    for label in tail_labels:
        offsets[label] = position
        position += len(tail[label])
    code = []
    for index, (op, k, label) in enumerate(body):
        jump = offsets[label] - index - 1
        if jump > 255:
            raise AssertionError("seccomp program too long for a one-byte jump")
        code.append(_instruction(op, k, jt=jump, jf=0))
    return b"".join(head + code + [i for label in tail_labels for i in tail[label]])


def program() -> bytes | None:
    """This machine's filter, or None where the course has none for its architecture."""
    if platform.machine() == "x86_64":
        return x86_64_program()
    return None

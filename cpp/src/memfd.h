// memfd and file-seal constants for C libraries whose headers predate them (the values are
// the kernel's ABI). Included by the .cc files that make or check sealed memfds: lease.cc
// (fences), shm.cc (shared-memory grants); declares nothing else.
#pragma once

#include <fcntl.h>
#include <sys/mman.h>

#ifndef F_ADD_SEALS
#define F_ADD_SEALS 1033
#define F_GET_SEALS 1034
#define F_SEAL_SEAL 0x0001
#define F_SEAL_SHRINK 0x0002
#define F_SEAL_GROW 0x0004
#endif
#ifndef MFD_CLOEXEC
#define MFD_CLOEXEC 0x0001U
#define MFD_ALLOW_SEALING 0x0002U
#endif

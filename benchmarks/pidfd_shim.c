/* valgrind (3.19) has no pidfd_open: the leased path would never run under callgrind. This
   shim answers pidfd_open with the read end of a pipe nobody writes: poll() never finds it
   readable, as a live owner's pidfd. Measurement only (benchmarks/call_instructions.py
   --leased), compiled by it;
   never loaded by the product. */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <stdarg.h>
#include <sys/syscall.h>
#include <unistd.h>
#include <fcntl.h>
long syscall(long n, ...) {
  va_list ap;
  va_start(ap, n);
  long a[6];
  for (int i = 0; i < 6; ++i) a[i] = va_arg(ap, long);
  va_end(ap);
  if (n == 434) {
    int p[2];
    if (pipe2(p, O_CLOEXEC) != 0) return -1;
    return p[0];
  }
  static long (*real)(long, ...) = 0;
  if (!real) real = (long (*)(long, ...))dlsym(RTLD_NEXT, "syscall");
  return real(n, a[0], a[1], a[2], a[3], a[4], a[5]);
}

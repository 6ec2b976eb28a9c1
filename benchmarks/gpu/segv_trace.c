/* LD_PRELOAD helper for device diagnosis (benchmarks/gpu/diag_abi.sh): on SIGSEGV / SIGBUS / SIGABRT,
 * prints the faulting address and the native stack as "library +offset [symbol]" lines (offsets are
 * relative to each library's load base, so `addr2line -f -C -e LIB OFFSET` resolves hidden symbols),
 * then re-raises the signal with the default action. Not part of the library. */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <execinfo.h>
#include <signal.h>
#include <stdio.h>
#include <string.h>
#include <unistd.h>

static void handler(int sig, siginfo_t* info, void* ctx) {
  (void)ctx;
  void* frames[64];
  int n = backtrace(frames, 64);
  fprintf(stderr, "SEGV_TRACE signal %d at address %p, %d frames\n", sig, info ? info->si_addr : 0, n);
  for (int i = 0; i < n; ++i) {
    Dl_info d;
    if (dladdr(frames[i], &d) && d.dli_fname) {
      fprintf(stderr, "SEGV_FRAME %s +0x%lx [%s]\n", d.dli_fname,
              (unsigned long)((char*)frames[i] - (char*)d.dli_fbase), d.dli_sname ? d.dli_sname : "?");
    } else {
      fprintf(stderr, "SEGV_FRAME ? %p\n", frames[i]);
    }
  }
  fflush(stderr);
  signal(sig, SIG_DFL);
  raise(sig);
}

__attribute__((constructor)) static void install(void) {
  struct sigaction sa;
  memset(&sa, 0, sizeof(sa));
  sa.sa_sigaction = handler;
  sa.sa_flags = SA_SIGINFO | SA_ONSTACK;
  sigaction(SIGSEGV, &sa, 0);
  sigaction(SIGBUS, &sa, 0);
  sigaction(SIGABRT, &sa, 0);
}

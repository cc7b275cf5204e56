// The fiber context switch both emulator dialects' schedulers use (x86-64 System V): saves the
// callee-saved registers on the current stack, stores its stack pointer in *from_sp, switches
// to to_sp and restores the registers saved there. Include from exactly one translation unit of
// a binary (the dialect's emu.cc): it defines the symbol.
#pragma once
#include <sanitizer/common_interface_defs.h>
#if !defined(__SANITIZE_ADDRESS__)
#define __sanitizer_start_switch_fiber(...) ((void)0)
#define __sanitizer_finish_switch_fiber(...) ((void)0)
#endif

extern "C" void emu_switch(void** from_sp, void* to_sp);
asm(R"(
.text
.globl emu_switch
.type emu_switch,@function
emu_switch:
  pushq %rbp
  pushq %rbx
  pushq %r12
  pushq %r13
  pushq %r14
  pushq %r15
  movq %rsp, (%rdi)
  movq %rsi, %rsp
  popq %r15
  popq %r14
  popq %r13
  popq %r12
  popq %rbx
  popq %rbp
  ret
)");

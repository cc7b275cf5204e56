# Rewrites a .cu file into C++ for the fiber emulator: kernel launches become emu::Launch calls,
# extern __shared__ arrays point at the block's dynamic shared memory, static __shared__
# declarations become statics registered for a garbage refill before every block.
import re, sys
s = open(sys.argv[1]).read()
s = re.sub(r'extern __shared__ (?:__align__\(\d+\) )?(\w+) (\w+)\[\];',
           r'\1* \2 = reinterpret_cast<\1*>(::emu::SharedMem());', s)
count = [0]
def shared(m):
    indent, align, typ, decls = m.group(1), m.group(2) or '', m.group(3), m.group(4)
    names = [re.match(r'\s*(\w+)', d).group(1) for d in decls.split(',')]
    count[0] += 1
    regs = ', '.join('::emu::RegisterShared((void*)&%s, sizeof(%s))' % (n, n) for n in names)
    return '%s%sstatic %s %s; static const bool emu_shared_reg_%d = (%s, true); (void)emu_shared_reg_%d;' % (
        indent, align, typ, decls, count[0], regs, count[0])
s = re.sub(r'^(\s*)__shared__\s+(__align__\(\d+\)\s+)?([\w:]+)\s+([^;]+);', shared, s, flags=re.M)
def launch(m):
    # By value: a launch recorded by stream capture runs after the wrapper's locals are gone.
    return 'emu::Launch([=] { %s(%s); }, %s);' % (m.group(1), m.group(3), m.group(2))
s, n = re.subn(r'([\w:]+(?:<\w+>)?)\s*<<<(.*?)>>>\s*\((.*?)\);', launch, s, flags=re.S)
sys.stderr.write('%s: launches %d, static shared %d\n' % (sys.argv[1], n, count[0]))
open(sys.argv[2], 'w').write(s)

# Rewrites a .cu file into C++ for the fiber emulator: kernel launches become emu::Launch calls,
# extern __shared__ arrays point at the block's dynamic shared memory, static __shared__
# declarations become per-block storage (see include/cuda_runtime.h).
import re, sys
s = open(sys.argv[1]).read()
s = re.sub(r'extern __shared__ (?:__align__\(\d+\) )?(\w+) (\w+)\[\];',
           r'\1* \2 = reinterpret_cast<\1*>(::emu::SharedMem());', s)
count = [0]
def shared(m):
    # Per block, as tests/cuda_emulator/kernels/transform.py: a tag per variable, the storage
    # looked up (allocated on the block's first use) through emu::SharedAligned.
    indent, align, typ = m.group(1), m.group(2), m.group(3)
    a = re.search(r'\d+', align).group(0) if align else '1'
    out = []
    for d in m.group(4).split(','):
        dm = re.match(r'\s*(\w+)\s*((?:\[[^\]]+\])*)\s*$', d)
        assert dm, d
        name, dims = dm.group(1), dm.group(2)
        count[0] += 1
        out.append('static char emu_tag_%s; auto& %s = ::emu::SharedAligned<%s %s, %s>(&emu_tag_%s);'
                   % (name, name, typ, dims, a, name))
    return indent + ' '.join(out)
s = re.sub(r'^(\s*)__shared__\s+(__align__\(\d+\)\s+)?([\w:]+)\s+([^;]+);', shared, s, flags=re.M)
def launch(m):
    # By value: a launch recorded by stream capture runs after the wrapper's locals are gone.
    return 'emu::Launch([=] { %s(%s); }, %s);' % (m.group(1), m.group(3), m.group(2))
s, n = re.subn(r'([\w:]+(?:<\w+>)?)\s*<<<(.*?)>>>\s*\((.*?)\);', launch, s, flags=re.S)
sys.stderr.write('%s: launches %d, static shared %d\n' % (sys.argv[1], n, count[0]))
open(sys.argv[2], 'w').write(s)

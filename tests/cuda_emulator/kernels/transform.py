# Rewrites a .cu file for the CPU emulator: kernel launches become emu::Launch calls, shared
# memory declarations become per-block allocations (see include/cuda_runtime.h).
import re, sys
s = open(sys.argv[1]).read()

def ext(m):
    align, typ, name = m.group(1), m.group(2), m.group(3)
    return '%s* %s = reinterpret_cast<%s*>(::emu::SharedMem());' % (typ, name, typ)
s, n_ext = re.subn(r'extern\s+__shared__\s+(__align__\(\d+\)\s+)?([\w:]+)\s+(\w+)\[\];', ext, s)

def static(m):
    align = m.group(1)
    typ = m.group(2)
    out = []
    for d in m.group(3).split(','):
        d = d.strip()
        dm = re.match(r'(\w+)\s*((?:\[[^\]]+\])*)$', d)
        assert dm, d
        name, dims = dm.group(1), dm.group(2)
        a = re.search(r'\d+', align).group(0) if align else '1'
        out.append('static char emu_tag_%s; auto& %s = ::emu::SharedAligned<%s %s, %s>(&emu_tag_%s);'
                   % (name, name, typ, dims, a, name))
    return ' '.join(out)
s, n_sh = re.subn(r'(?<!extern )__shared__\s+(__align__\(\d+\)\s+)?([\w:]+)\s+([^;]+);', static, s)

def launch(m):
    k = m.group(1)
    return 'emu::Launch("%s", [&] { %s(%s); }, %s);' % (k, k, m.group(3), m.group(2))
s, n = re.subn(r'([\w:]+(?:<\w+>)?)\s*<<<(.*?)>>>\s*\((.*?)\);', launch, s, flags=re.S)
sys.stderr.write('%s: launches %d, static shared %d, extern shared %d\n' % (sys.argv[1], n, n_sh, n_ext))
open(sys.argv[2], 'w').write(s)

# Summary of docs/benchmarks/serve-persist/profile.sh: python3 profile_summary.py OUT "off on ..."
# ("off" must be one of the names). Throughput per round, on/off per round, perf samples per
# generated token (499 Hz: x 2.004 = ms of CPU), split into the two busiest threads (decode: the
# step thread and the kernel pool worker) and the rest (the store's writers, gRPC, ...).
import json,glob,re,subprocess,sys,os
d=sys.argv[1]; names=sys.argv[2].split()
rounds=sorted({int(re.search(r'-(\d+)\.json',f).group(1)) for f in glob.glob(d+'/serve-*.json')})
tp={}
for n in names:
    for r in rounds:
        f=f'{d}/serve-{n}-{r}.json'
        if os.path.exists(f):
            j=json.load(open(f)); tp[(n,r)]=(j['throughput']['output_tokens_per_s'],j['e2e_ms']['mean'],j['ttft_ms']['mean'],j['itl_ms']['mean'],j['tokens']['output'])
for n in names:
    vals=[tp.get((n,r)) for r in rounds]
    s=' '.join(f"{v[0]:.1f}" if v else '-' for v in vals)
    rat=[tp[(n,r)][0]/tp[('off',r)][0] for r in rounds if (n,r) in tp and ('off',r) in tp]
    mean_tp=sum(v[0] for v in vals if v)/max(1,len([v for v in vals if v]))
    offm=sum(tp[('off',r)][0] for r in rounds if ('off',r) in tp)/len(rounds)
    print(f"{n:6s} tok/s {s} | on/off {' '.join(f'{x:.2f}' for x in rat)} | mean {sum(rat)/max(1,len(rat)):.2f} | ratio of means {mean_tp/offm:.2f} | e2e {' '.join(f'{tp[(n,r)][1]:.0f}' for r in rounds if (n,r) in tp)} ttft {' '.join(f'{tp[(n,r)][2]:.0f}' for r in rounds if (n,r) in tp)}")
# perf
for n in names:
    f=f'{d}/perf-{n}.data'
    if not os.path.exists(f): continue
    out=subprocess.run(['perf','report','-i',f,'--no-children','--sort','pid','-g','none','--stdio'],capture_output=True,text=True).stdout
    rows=[(float(m.group(1)),m.group(2)) for m in re.finditer(r'^\s+([\d.]+)%\s+(\d+):',out,re.M)]
    st=subprocess.run(['perf','report','-i',f,'--stats'],capture_output=True,text=True).stdout
    total=int(re.search(r'SAMPLE events:\s+(\d+)',st).group(1))
    tok=sum(tp[(n,r)][4] for r in rounds if (n,r) in tp)
    top2=sum(p for p,_ in rows[:2])
    print(f"{n:6s} samples {total} tokens {tok} samples/token {total/tok:.2f} ({total/tok/499*1000:.1f} ms CPU/token); top-2 threads (decode) {top2:.1f}% = {top2*total/100/tok:.2f}/token; rest {100-top2:.1f}% = {(100-top2)*total/100/tok:.2f}/token")

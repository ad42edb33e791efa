"""Section-targeted mutation fuzzer for the logrel-aw sections of the numpy reader.

    nice python bench/fuzz_reader_aw.py SECONDS [OUT_DIR]

Seeds: the odd-values checkpoint (sparse escape index) and a tensor with a third of its
coordinates escaped (bitmask), both logrel-aw.  Each case overwrites 1-8 bytes inside one
section of one moments entry (random byte, 0xff, 0x00, 0x80 or a bit flip) and reseals
the payload and file hashes, so that the layout and decode checks are reached.  Anything
other than ReaderError is a finding (crash-*); one input per distinct rejection message
is written to OUT_DIR (default /tmp/awfuzz2) for tests/fuzz_corpus.
"""
import sys, random, time, hashlib, collections
import os
HERE=os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0,HERE); sys.path.insert(0,os.path.dirname(HERE))
import numpy as np
from fuzz_reader import split, reseal
from jaxguard.format import reader
import torch_compat
from torch_compat.models import odd_values_checkpoint
import jaxguard.core.guard as G
from jaxguard.format import container
seeds=[torch_compat.compress_checkpoint(odd_values_checkpoint(), codec='logrel-aw')[0]]
rng0=np.random.default_rng(1); n=256*8
v=rng0.lognormal(-14,1,n).astype(np.float32); m=(rng0.normal(0,1,n)*np.sqrt(v)*.3).astype(np.float32); m[::3]=np.nan
e=G.encode(m,v,rng0.normal(0,.05,n).astype(np.float32),G.GuardConfig(lr=1e-3,step=100,codec='logrel-aw'))
seeds.append(container.build([("moments","x",e,{})],{}))
rng=random.Random(17); t0=time.time(); execs=0; msgs=collections.Counter(); keep={}
while time.time()-t0 < float(sys.argv[1]):
    sd=rng.choice(seeds); h,p=split(sd)
    ents=[x for x in h['entries'] if x.get('kind')=='moments']
    ent=rng.choice(ents); sec=rng.choice(sorted(ent['sections'])); b,e2=ent['sections'][sec]
    if e2<=b: continue
    p=bytearray(p)
    for _ in range(rng.choice((1,1,2,8))):
        i=rng.randrange(b,e2); p[i]=rng.choice((rng.randrange(256), 0xff, 0x00, 0x80, p[i]^(1<<rng.randrange(8))))
    data=reseal(h,bytes(p)); execs+=1
    try:
        reader.verify_bytes(data); k='OK(decoded hash matched)'
    except reader.ReaderError as ex:
        import re; k=sec+': '+re.sub(r'0x[0-9a-f]+|[0-9]+','#',str(ex))[:90]
    except Exception as ex:
        k='FINDING '+type(ex).__name__+' '+str(ex)[:80]
    msgs[k]+=1
    if k not in keep: keep[k]=data
print('execs',execs)
for k,c in msgs.most_common(): print(c,k)
import os
out=sys.argv[2] if len(sys.argv)>2 else '/tmp/awfuzz2'
os.makedirs(out,exist_ok=True)
for k,d in keep.items():
    if k.startswith('OK'): continue
    tag='crash' if k.startswith('FINDING') else 'reject-aw'
    open(f'{out}/{tag}-{hashlib.sha256(d).hexdigest()[:12]}.bin','wb').write(d)

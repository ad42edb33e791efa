#!/bin/bash
# Whole-process compress / restore of one 137,216-coordinate torch checkpoint (bench/.cache transformer
# seed 701 at 100%, saved as /tmp/t701.pt) with log8-rel and logrel-ans beside a plain torch load+save,
# twice, interleaved; the second XDG cache run is warm.  Results: bench/results/codec_speed_process.md
set -e
export XDG_CACHE_HOME=/tmp/spcache
for r in 1 2; do
  /usr/bin/time -f "plain %e s %M KB" python -c "import torch; torch.save(torch.load('/tmp/t701.pt', weights_only=False), '/tmp/t_plain.pt')"
  for c in log8-rel logrel-ans; do
    /usr/bin/time -f "compress $c %e s %M KB" jaxguard compress /tmp/t701.pt -o /tmp/t_$c.jg --codec $c > /dev/null
    /usr/bin/time -f "restore $c %e s %M KB" jaxguard restore /tmp/t_$c.jg -o /tmp/t_$c.back.pt > /dev/null
  done
done

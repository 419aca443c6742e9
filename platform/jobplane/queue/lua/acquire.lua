-- Take a lock, or extend it if the caller already owns it. KEYS[1] lock; ARGV[1] owner, ARGV[2] ttl ms
if redis.call('GET', KEYS[1]) == ARGV[1] then
  return redis.call('PEXPIRE', KEYS[1], ARGV[2])
end
if redis.call('SET', KEYS[1], ARGV[1], 'NX', 'PX', ARGV[2]) then
  return 1
end
return 0

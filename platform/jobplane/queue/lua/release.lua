-- Delete a lock only for its owner. KEYS[1] lock; ARGV[1] owner
if redis.call('GET', KEYS[1]) == ARGV[1] then
  return redis.call('DEL', KEYS[1])
end
return 0

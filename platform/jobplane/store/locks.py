"""The floor of the locks' fencing tokens, which Redis hands out from blocks allotted here.

MongoDB keeps how far the blocks reached (`job_meta`, `_id: "lock_tokens"`); a Redis that was
wiped gets its next block past every token it could have handed out, so the tokens a
downstream system sees keep growing whatever Redis loses.
"""

from pymongo import ReturnDocument

from jobplane.store.database import Collections

# Tokens a block holds: one MongoDB write per million locks taken.
TOKEN_BLOCK = 1_000_000


class MongoLockStore:
    def __init__(self, db: Collections) -> None:
        self._db = db

    async def token_block(self) -> tuple[int, int]:
        """A block of tokens no Redis was given before: (the last token before it, its last
        token)."""
        doc = await self._db.meta.find_one_and_update(
            {"_id": "lock_tokens"},
            {"$inc": {"ceiling": TOKEN_BLOCK}},
            upsert=True,
            return_document=ReturnDocument.AFTER,
        )
        assert doc is not None
        end = int(doc["ceiling"])
        return end - TOKEN_BLOCK, end

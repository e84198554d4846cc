"""A client of the labeling server's JSON API (what the page does), for scripted labelers and tests; stdlib only."""

import json
import urllib.error
import urllib.request
from collections.abc import Callable


class LabelServerError(Exception):
    """The server answered with an error status."""

    def __init__(self, status: int, message: str):
        super().__init__(f"{status}: {message}")
        self.status = status


class LabelClient:
    """Calls of one labeler to a running `label_generation.py serve`. `key`: the labeler key the server gave this
    name at its first use (kept from the first answer; pass it to continue a name in another program)."""

    def __init__(self, url: str, labeler: str, token: str | None = None, timeout: float = 30.0, key: str | None = None):
        self.url, self.labeler, self.token, self.timeout, self.key = url.rstrip("/"), labeler, token, timeout, key

    def _call(self, method: str, path: str, body: dict | None = None) -> dict:
        """One request; the JSON reply, or LabelServerError."""
        headers = {"X-Label-Token": self.token} if self.token else {}
        data = None
        if body is not None:
            headers["Content-Type"] = "application/json"
            data = json.dumps({**body, "key": self.key}).encode()
        request = urllib.request.Request(self.url + path, data=data, headers=headers, method=method)
        try:
            with urllib.request.urlopen(request, timeout=self.timeout) as response:
                answer = json.loads(response.read())
                self.key = answer.get("labeler_key", self.key)
                return answer
        except urllib.error.HTTPError as e:
            message = json.loads(e.read() or b"{}").get("error", e.reason)
            raise LabelServerError(e.code, message) from None

    def info(self) -> dict:
        return self._call("GET", "/api/info")

    def next(self) -> dict:
        """Claim the next row for this labeler (row None when none is left), responses in the order they are shown."""
        return self._call("POST", "/api/next", {"labeler": self.labeler})

    def judge(self, row: int, answer: int) -> dict:
        return self._call("POST", "/api/judge", {"labeler": self.labeler, "row": row, "answer": answer})

    def skip(self, row: int) -> dict:
        return self._call("POST", "/api/skip", {"labeler": self.labeler, "row": row})

    def undo(self) -> dict:
        return self._call("POST", "/api/undo", {"labeler": self.labeler})

    def stats(self) -> dict:
        return self._call("GET", "/api/stats")

    def label_all(self, answer: Callable[[dict], int], limit: int | None = None) -> int:
        """Answer rows with `answer(next_row)` until none is left (or `limit` rows); -> rows labelled."""
        done, row = 0, self.next()
        while row["row"] is not None and (limit is None or done < limit):
            row = self.judge(row["row"], answer(row))["next"]
            done += 1
        return done

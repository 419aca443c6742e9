// A line diff (longest common subsequence), for comparing two template versions as JSON.

export function lineDiff(before, after) {
  const a = before.split("\n");
  const b = after.split("\n");
  // Texts this long would need a large table; show them as removed and added whole.
  if (a.length * b.length > 4_000_000) {
    return [...a.map((text) => ({ op: "del", text })), ...b.map((text) => ({ op: "add", text }))];
  }
  const common = Array.from({ length: a.length + 1 }, () => new Uint32Array(b.length + 1));
  for (let i = a.length - 1; i >= 0; i -= 1) {
    for (let j = b.length - 1; j >= 0; j -= 1) {
      common[i][j] = a[i] === b[j] ? common[i + 1][j + 1] + 1 : Math.max(common[i + 1][j], common[i][j + 1]);
    }
  }
  const lines = [];
  let i = 0;
  let j = 0;
  while (i < a.length && j < b.length) {
    if (a[i] === b[j]) {
      lines.push({ op: "same", text: a[i] });
      i += 1;
      j += 1;
    } else if (common[i + 1][j] >= common[i][j + 1]) {
      lines.push({ op: "del", text: a[i] });
      i += 1;
    } else {
      lines.push({ op: "add", text: b[j] });
      j += 1;
    }
  }
  while (i < a.length) lines.push({ op: "del", text: a[i++] });
  while (j < b.length) lines.push({ op: "add", text: b[j++] });
  return lines;
}

// The changed lines with `context` unchanged lines around each change; longer unchanged
// stretches become one {op: "gap", text: "… N unchanged lines"}.
export function withContext(lines, context = 3) {
  const keep = lines.map(() => false);
  lines.forEach((line, i) => {
    if (line.op === "same") return;
    for (let k = Math.max(0, i - context); k <= Math.min(lines.length - 1, i + context); k += 1) keep[k] = true;
  });
  const shown = [];
  let skipped = 0;
  lines.forEach((line, i) => {
    if (keep[i]) {
      if (skipped) shown.push({ op: "gap", text: `… ${skipped} unchanged line${skipped === 1 ? "" : "s"}` });
      skipped = 0;
      shown.push(line);
    } else skipped += 1;
  });
  if (skipped) shown.push({ op: "gap", text: `… ${skipped} unchanged line${skipped === 1 ? "" : "s"}` });
  return shown;
}

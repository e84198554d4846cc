// Agreement statistics page; labeler names are untrusted and only set through textContent. The access token, when
// the server needs one, is an HttpOnly cookie (see app.js).
"use strict";

function figure(value) {
  return value === null || value === undefined ? "n/a" : value.toFixed(3);
}

function row(table, cells) {
  const headings = [...table.querySelectorAll("thead th")].map((th) => th.textContent);
  const tr = document.createElement("tr");
  cells.forEach((cell, i) => {
    const td = document.createElement("td");
    td.textContent = String(cell);
    td.dataset.label = headings[i]; // the heading shown beside the value when a narrow screen stacks the table
    tr.append(td);
  });
  table.querySelector("tbody").append(tr);
}

function text(id, value) {
  document.getElementById(id).textContent = value;
}

async function main() {
  const response = await fetch("/api/stats", { credentials: "same-origin" });
  const stats = await response.json().catch(() => ({}));
  if (!response.ok) {
    text("status", stats.error || `request failed (${response.status})`);
    return;
  }
  if (stats.export_error) {
    const banner = document.getElementById("export-error");
    banner.hidden = false;
    banner.textContent = `The judgements are saved, but ${stats.export_error}; it is tried again every few seconds.`;
  }
  text(
    "summary",
    `${stats.rows_labelled} of ${stats.rows} rows labelled; ${stats.shared_rows} rows labelled by two or more labelers.`,
  );
  const labelers = document.getElementById("labelers");
  for (const [name, counts] of Object.entries(stats.labelers)) {
    const majority = stats.majority_agreement[name];
    row(labelers, [name, counts.labels, counts.skipped, counts.shared_rows, `${figure(majority.agreement)} (${majority.rows} rows)`]);
  }
  const pairs = document.getElementById("pairs");
  for (const pair of stats.pairs) {
    row(pairs, [pair.labelers.join(" & "), pair.rows, figure(pair.agreement), figure(pair.cohen_kappa)]);
  }
  text("pairs-left-out", stats.pairs_left_out ? `Not listed: ${stats.pairs_left_out}.` : "");
  text("fleiss", `Fleiss' kappa over the shared rows: ${figure(stats.fleiss_kappa)}`);
  text("krippendorff", `Krippendorff's alpha (nominal) over the shared rows: ${figure(stats.krippendorff_alpha)}`);
  text("rule", `Label file: ${stats.majority_rule}.`);
  document.body.dataset.loaded = "1";
}

main();

// Agreement statistics page; labeler names are untrusted and only set through textContent.
"use strict";

const TOKEN = sessionStorage.getItem("labelToken") || new URLSearchParams(window.location.search).get("token") || "";

function figure(value) {
  return value === null || value === undefined ? "n/a" : value.toFixed(3);
}

function row(table, cells) {
  const tr = document.createElement("tr");
  for (const cell of cells) {
    const td = document.createElement("td");
    td.textContent = String(cell);
    tr.append(td);
  }
  table.querySelector("tbody").append(tr);
}

async function main() {
  const response = await fetch("/api/stats", { headers: { "X-Label-Token": TOKEN } });
  const stats = await response.json().catch(() => ({}));
  if (!response.ok) {
    document.getElementById("status").textContent = stats.error || `request failed (${response.status})`;
    return;
  }
  document.getElementById("summary").textContent =
    `${stats.rows_labelled} of ${stats.rows} rows labelled; ${stats.shared_rows} rows labelled by two or more labelers.`;
  const labelers = document.getElementById("labelers");
  for (const [name, counts] of Object.entries(stats.labelers)) {
    const majority = stats.majority_agreement[name];
    row(labelers, [name, counts.labels, counts.skipped, counts.shared_rows, `${figure(majority.agreement)} (${majority.rows} rows)`]);
  }
  const pairs = document.getElementById("pairs");
  for (const pair of stats.pairs) {
    row(pairs, [pair.labelers.join(" & "), pair.rows, figure(pair.agreement), figure(pair.cohen_kappa)]);
  }
  document.getElementById("fleiss").textContent = `Fleiss' kappa over the shared rows: ${figure(stats.fleiss_kappa)}`;
  document.getElementById("rule").textContent = `Label file: ${stats.majority_rule}.`;
  document.body.dataset.loaded = "1";
}

main();

// Shared by /pools and /playground: the colour of a sequence (Okabe-Ito and
// Tol: palettes readable with the common colour-vision deficiencies) and escaping.
"use strict";
// Colours go to sequences in the order the page first meets them, so the
// first twelve on screen are all told apart.
const PALETTE = [
  ["#0072B2", "#fff"], ["#E69F00", "#000"], ["#009E73", "#fff"], ["#CC79A7", "#000"],
  ["#56B4E9", "#000"], ["#D55E00", "#fff"], ["#F0E442", "#000"], ["#332288", "#fff"],
  ["#882255", "#fff"], ["#999933", "#000"], ["#44AA99", "#000"], ["#661100", "#fff"],
];
const seen = new Map();
function seqColour(name) {
  let i = seen.get(name);
  if (i === undefined) {
    if (seen.size >= 10000) seen.clear();  // a page left open for days
    i = seen.size % PALETTE.length; seen.set(name, i);
  }
  return PALETTE[i];
}
function esc(s) {
  return String(s).replace(/[&<>"']/g, (c) => ({ "&": "&amp;", "<": "&lt;", ">": "&gt;", '"': "&quot;", "'": "&#39;" }[c]));
}

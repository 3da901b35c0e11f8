// Shared by /pools and /playground: the colour of a sequence (Okabe-Ito, a
// palette readable with the common colour-vision deficiencies) and escaping.
"use strict";
const PALETTE = [
  ["#0072B2", "#fff"], ["#E69F00", "#000"], ["#009E73", "#fff"], ["#CC79A7", "#000"],
  ["#56B4E9", "#000"], ["#D55E00", "#fff"], ["#F0E442", "#000"], ["#332288", "#fff"],
  ["#882255", "#fff"], ["#117733", "#fff"], ["#44AA99", "#000"], ["#999933", "#000"],
];
function seqColour(name) {
  let h = 2166136261;
  for (let i = 0; i < name.length; i++) { h ^= name.charCodeAt(i); h = Math.imul(h, 16777619); }
  return PALETTE[(h >>> 0) % PALETTE.length];
}
function esc(s) {
  return String(s).replace(/[&<>"']/g, (c) => ({ "&": "&amp;", "<": "&lt;", ">": "&gt;", '"': "&quot;", "'": "&#39;" }[c]));
}

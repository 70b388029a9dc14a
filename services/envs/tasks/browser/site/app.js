// Shared by the pages: JSON calls to the site's server and the cart (kept in localStorage).
async function api(action, data) {
  const r = await fetch('/api/' + action, {
    method: 'POST', headers: {'Content-Type': 'application/json'}, body: JSON.stringify(data)});
  if (!r.ok) throw new Error('request failed: ' + r.status);
  return r.json();
}
async function siteState() { return (await fetch('/api/state')).json(); }
const PRODUCTS = {
  mug: {name: 'Trail Mug', price: 14},
  tote: {name: 'Canvas Tote', price: 22},
  lamp: {name: 'Desk Lamp', price: 39},
  notebook: {name: 'Dot Notebook', price: 9},
};
function getCart() { return JSON.parse(localStorage.getItem('cart') || '{}'); }
function setCart(c) { localStorage.setItem('cart', JSON.stringify(c)); }
